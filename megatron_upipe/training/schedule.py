"""The LR schedule of a run, and which schedule is in effect after a checkpoint is loaded.

megatron-core's `OptimizerParamScheduler` stores its settings (lr, min_lr, warmup steps, decay steps, decay style)
in the checkpoint with its step count. `checkpoint.scheduler` chooses what a run that loads a checkpoint follows:
  checkpoint  the checkpoint's settings (megatron's use_checkpoint_opt_param_scheduler, the default): the curve the
              run started on, whatever the config says now. Raising train.steps then trains the extra steps at
              the checkpoint's min_lr once its decay horizon is passed;
  config      this config's settings (megatron's override_opt_param_scheduler), e.g. to decay over a raised
              train.steps; the LR jumps to the new curve at the resumed step.
The step count always comes from the checkpoint. `RunScheduler` remembers the settings of the checkpoint it loaded,
so `schedule_line` can say in one line which schedule is in effect, what the other one was, and how to switch.
"""

from __future__ import annotations

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_upipe.config import Config

SETTINGS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")
_OLD_NAMES = {"max_lr": ("start_lr",), "lr_warmup_steps": ("warmup_iter", "warmup_steps"),
              "lr_decay_steps": ("end_iter", "decay_steps"), "lr_decay_style": ("decay_style",)}  # megatron's


class RunScheduler(OptimizerParamScheduler):
    """megatron-core's scheduler; `loaded` holds the settings of the checkpoint it loaded (None before a load)."""

    loaded: dict | None = None

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = {k: next((state_dict[n] for n in (*_OLD_NAMES.get(k, ()), k) if n in state_dict), None)
                       for k in SETTINGS}
        super().load_state_dict(state_dict)


def build_scheduler(optimizer, config: Config) -> RunScheduler:
    """Linear warmup from 0, then train.lr_decay_style down to train.min_lr (see optim.py)."""
    t = config.train
    from_checkpoint = config.checkpoint.scheduler == "checkpoint"
    return RunScheduler(
        optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.lr_warmup_steps,
        lr_decay_steps=t.decay_steps, lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay,
        end_wd=t.weight_decay, wd_incr_steps=t.steps, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=from_checkpoint, override_opt_param_scheduler=not from_checkpoint,
    )


def settings_of(config: Config) -> dict:
    t = config.train
    return {"max_lr": float(t.lr), "min_lr": float(t.min_lr), "lr_warmup_steps": t.lr_warmup_steps,
            "lr_decay_steps": t.decay_steps, "lr_decay_style": t.lr_decay_style}


def describe(s: dict, only=SETTINGS) -> str:
    words = {"max_lr": f"lr {s['max_lr']:g}", "min_lr": f"min_lr {s['min_lr']:g}",
             "lr_warmup_steps": f"warmup {s['lr_warmup_steps']} steps",
             "lr_decay_steps": f"decay to step {s['lr_decay_steps']}", "lr_decay_style": f"{s['lr_decay_style']}"}
    return ", ".join(words[k] for k in SETTINGS if k in only)


def schedule_line(scheduler: RunScheduler, config: Config) -> str:
    """One line after a checkpoint load: the schedule in effect, how it differs from the other, how to switch."""
    mode, steps = config.checkpoint.scheduler, config.train.steps
    ours, saved = settings_of(config), scheduler.loaded
    effective = {k: getattr(scheduler, k) for k in SETTINGS}
    tail = ""
    if effective["lr_decay_style"] != "constant" and effective["lr_decay_steps"] < steps:
        tail = (f"; steps {effective['lr_decay_steps'] + 1}-{steps} run at min_lr {effective['min_lr']:g} "
                f"(train.steps={steps})")
    if saved is None or all(saved[k] == ours[k] for k in SETTINGS):
        return f"LR schedule: {describe(effective)} (the checkpoint's and the config's agree){tail}"
    differ = [k for k in SETTINGS if saved[k] != ours[k]]
    if mode == "checkpoint":
        return (f"LR schedule: the checkpoint's ({describe(effective)}){tail}; the config asks for "
                f"{describe(ours, differ)}: set checkpoint.scheduler=config to follow the config")
    return (f"LR schedule: the config's ({describe(effective)}){tail}, by checkpoint.scheduler=config; the checkpoint "
            f"had {describe(saved, differ)} (checkpoint.scheduler=checkpoint keeps it)")
