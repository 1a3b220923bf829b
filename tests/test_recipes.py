"""Every shipped config dry-runs at its intended world size; every shell recipe parses and, with fake `srun`,
`torchrun`, `scontrol` and `nvidia-smi` on PATH that record their arguments (and SLURM_* variables set as Slurm
sets them), resolves its config into the run directory and launches the right command. Nothing is launched.
tests/test_slurm.py runs the 8xH100 recipe under a real Slurm."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_upipe.config import load_config
from megatron_upipe.training.recipe_times import sbatch_config, sbatch_directives
from tests.dist_helper import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
SBATCH = sorted((ROOT / "examples" / "slurm").glob("*.sbatch"))
SHELL_RECIPES = [*SBATCH, *sorted((ROOT / "examples").rglob("*.sh")), *sorted((ROOT / "tools" / "ci").glob("*.sh"))]
SINGLE_NODE = ROOT / "examples" / "torchrun_single_node.sh"

# Records {"argv", "cwd", "env"} as one JSON line in $FAKE_LOG/<name>.jsonl; srun then runs its command (the first
# argument that is not an option: the recipes write srun options as --opt=value), scontrol prints the hosts in
# $FAKE_HOSTS, nvidia-smi lists $FAKE_GPUS GPUs, torchrun exits 0.
FAKE = """#!{python}
import json, os, sys
name = os.path.basename(sys.argv[0])
if name == "torchrun" and sys.argv[1:] == ["--help"]:  # the launchers ask whether it has --numa-binding
    print("  --numa-binding {{node,socket,exclusive,core-complex}}" if os.environ.get("FAKE_NUMA") else "")
    sys.exit(0)
with open(os.path.join(os.environ["FAKE_LOG"], name + ".jsonl"), "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}) + "\\n")
if name == "srun":
    cmd = next(i for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("-"))
    os.execvp(sys.argv[cmd], sys.argv[cmd:])
if name == "scontrol":
    print("\\n".join(os.environ["FAKE_HOSTS"].split()))
if name == "nvidia-smi":
    print("\\n".join(f"GPU {{i}}: NVIDIA H100 (UUID: GPU-{{i}})" for i in range(int(os.environ["FAKE_GPUS"]))))
if name == "torchrun" and os.environ.get("FAKE_STATUS"):  # the job's status file, then torchrun's own exit 1
    with open(sys.argv[sys.argv.index("--status-file") + 1], "w") as f:
        f.write(os.environ["FAKE_STATUS"] + "\\n")
    sys.exit(1)
"""


def world_size_of(config: Path) -> int:
    m = re.search(r"^# world_size: (\d+)$", config.read_text(), re.MULTILINE)
    assert m, f"{config.name} must state its intended world size in a '# world_size: N' line"
    return int(m.group(1))


def config_of(script: Path) -> Path:
    return ROOT / sbatch_config(script)


def test_every_config_dry_runs_at_its_world_size():
    procs = {
        c.name: subprocess.Popen([sys.executable, "pretrain_llama.py", "--config", str(c), "--dry-run",
                                  "--world-size", str(world_size_of(c))], cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for c in CONFIGS
    }
    assert len(procs) >= 3
    for name, p in procs.items():
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, f"{name}:\n{out}"
        assert "dry run: configuration is valid" in out, f"{name}:\n{out}"


@pytest.mark.parametrize("script", SHELL_RECIPES, ids=lambda p: p.name)
def test_shell_recipes_parse(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, r.stderr
    assert os.access(script, os.X_OK), f"{script} is not executable"


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.name)
def test_sbatch_resources_match_the_config(script):
    d = sbatch_directives(script)
    config = config_of(script)
    assert config.is_file()
    assert int(d["--nodes"]) * int(d["--gpus-per-node"]) == world_size_of(config)
    assert d["--ntasks-per-node"] == "1", "one torchrun per node"
    assert "--job-name" in d and "--time" in d


class Fakes:
    """A PATH with recording fakes, and a way to run a recipe against them."""

    def __init__(self, tmp_path: Path):
        self.bin = tmp_path / "bin"
        self.log = tmp_path / "log"
        self.bin.mkdir()
        self.log.mkdir()
        for name in ("srun", "torchrun", "scontrol", "nvidia-smi", "numactl"):
            f = self.bin / name
            f.write_text(FAKE.format(python=sys.executable))
            f.chmod(0o755)
        self.cwd = tmp_path / "elsewhere"  # the recipes must find the repository themselves
        self.cwd.mkdir()

    def run(self, script: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
        full = {"PATH": f"{self.bin}:{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/root"),
                "FAKE_LOG": str(self.log), "VENV": "none", "PYTHON": sys.executable, **env}
        return subprocess.run(["bash", str(script), *overrides], cwd=self.cwd, env=full, capture_output=True,
                              text=True, timeout=60)

    def calls(self, name: str) -> list[dict]:
        f = self.log / f"{name}.jsonl"
        return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


def slurm_env(nodes: int, gpus: int, job_id: int, run_dir: Path) -> dict[str, str]:
    """What sbatch puts in the batch script's environment on the first of `nodes` nodes."""
    return {
        "SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_JOB_NAME": "recipe-test",
        "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_JOB_NODELIST": f"gpu-[017-{16 + nodes:03d}]" if nodes > 1 else "gpu-017",
        "SLURM_GPUS_ON_NODE": str(gpus), "SLURM_CPUS_ON_NODE": "96", "SLURM_SUBMIT_DIR": str(ROOT),
        "FAKE_HOSTS": " ".join(f"gpu-{17 + i:03d}" for i in range(nodes)), "RUN_DIR": str(run_dir),
    }


def option(argv: list[str], name: str) -> str:
    """The value of `--name value` or `--name=value` in argv."""
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.name)
def test_sbatch_recipe_launches_torchrun_per_node(script, tmp_path):
    fakes = Fakes(tmp_path)
    nodes = int(sbatch_directives(script)["--nodes"])
    run_dir = tmp_path / "run"
    env = slurm_env(nodes, 8, 4242, run_dir)
    r = fakes.run(script, "train.steps=3", "train.lr=1e-4", EXTRA_ARGS="--dry-run",
                  SRUN_EXTRA_ARGS="--container-image=nvcr.io#x --no-container-mount-home", **env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dry run: configuration is valid" in r.stdout  # the pre-flight check at the launch's world size
    assert f"world {nodes * 8} = " in r.stdout

    (scontrol,) = fakes.calls("scontrol")
    assert scontrol["argv"] == ["show", "hostnames", env["SLURM_JOB_NODELIST"]]

    (srun,) = fakes.calls("srun")
    s = srun["argv"]
    assert option(s, "--nodes") == str(nodes) and option(s, "--ntasks-per-node") == "1"
    assert option(s, "--cpus-per-task") == "96" and option(s, "--kill-on-bad-exit") == "1"
    assert "--container-image=nvcr.io#x" in s and "--no-container-mount-home" in s
    assert s[next(i for i, a in enumerate(s) if not a.startswith("-"))] == "torchrun"

    (torchrun,) = fakes.calls("torchrun")
    t = torchrun["argv"]
    assert option(t, "--nnodes") == str(nodes) and option(t, "--nproc-per-node") == "8"
    assert option(t, "--rdzv-backend") == "c10d" and option(t, "--rdzv-id") == "4242"
    host, port = option(t, "--rdzv-endpoint").split(":")
    assert host == "gpu-017" and 1024 < int(port) < 32768
    assert t[t.index("pretrain_llama.py"):] == ["pretrain_llama.py", "--config", f"{run_dir}/config.yaml",
                                           "--status-file", f"{run_dir}/exit_status", "--dry-run"]
    assert torchrun["cwd"] == str(ROOT)
    e = torchrun["env"]
    assert e["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    # not added by the launcher: the job sets it where its config needs it (node_env.py)
    assert e.get("CUDA_DEVICE_MAX_CONNECTIONS") == os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")

    # The run directory holds the resolved config: the shipped one, the overrides, metrics in the run dir.
    resolved = load_config(str(run_dir / "config.yaml"), [])
    shipped = load_config(str(config_of(script)), [])
    assert resolved.train.steps == 3 and resolved.train.lr == 1e-4
    assert resolved.log.metrics_file == f"{run_dir}/metrics.jsonl"
    assert resolved.checkpoint.dir == f"{run_dir}/checkpoints"  # the run's own, not the config's shared one
    assert resolved.parallel == shipped.parallel and resolved.model == shipped.model
    assert resolved.train.seq_length == shipped.train.seq_length


def test_sbatch_environment_overrides(tmp_path):
    """NPROC_PER_NODE, MASTER_PORT and CONFIG from the environment; the user's override wins over the recipe's."""
    fakes = Fakes(tmp_path)
    run_dir = tmp_path / "run"
    env = slurm_env(1, 8, 77, run_dir) | {"NPROC_PER_NODE": "2", "MASTER_PORT": "23456",
                                          "CONFIG": "examples/configs/tiny_cpu.yaml"}
    r = fakes.run(SBATCH[0], f"log.metrics_file={tmp_path}/m.jsonl", "checkpoint.interval=0", **env)
    assert r.returncode == 0, r.stdout + r.stderr
    (torchrun,) = fakes.calls("torchrun")
    assert option(torchrun["argv"], "--nproc-per-node") == "2"
    assert option(torchrun["argv"], "--rdzv-endpoint") == "gpu-017:23456"
    assert torchrun["argv"][-4:] == ["--config", f"{run_dir}/config.yaml", "--status-file", f"{run_dir}/exit_status"]
    resolved = load_config(str(run_dir / "config.yaml"), [])
    assert resolved.model.preset == "tiny" and resolved.log.metrics_file == f"{tmp_path}/m.jsonl"


@pytest.mark.parametrize("case", ["bound", "NUMA_BINDING=none", "no GPU", "old torchrun"])
def test_ranks_are_bound_to_their_gpus_numa_node_where_torchrun_can(case, tmp_path):
    """With GPUs, numactl and a torchrun that has --numa-binding, the single-node and Slurm launchers run torchrun
    with --numa-binding node; otherwise without it and with a line saying why."""
    fakes = Fakes(tmp_path)
    env = {"FAKE_GPUS": "0" if case == "no GPU" else "8", "FAKE_NUMA": "" if case == "old torchrun" else "1",
           "RUN_DIR": str(tmp_path / "run"), "NUMA_BINDING": "none" if case == "NUMA_BINDING=none" else "node"}
    r = fakes.run(SINGLE_NODE, "train.steps=3", "dist.backend=gloo", "train.distributed_optimizer=false",
                  NPROC_PER_NODE="8", EXTRA_ARGS="--dry-run", **env)
    assert r.returncode == 0, r.stdout + r.stderr
    (torchrun,) = fakes.calls("torchrun")
    bound = "--numa-binding" in torchrun["argv"]
    assert bound == (case == "bound")
    if bound:
        assert option(torchrun["argv"], "--numa-binding") == "node"
    why = {"no GPU": "no GPU listed", "old torchrun": "has no --numa-binding"}.get(case)
    assert why is None or f"launch: no NUMA binding: " in r.stderr and why in r.stderr, r.stderr
    if case == "bound":
        (tmp_path / "slurm").mkdir()
        fakes = Fakes(tmp_path / "slurm")
        r = fakes.run(ROOT / "examples" / "slurm" / "llama3_8b_upipe_8xh100.sbatch", EXTRA_ARGS="--dry-run",
                      **(slurm_env(1, 8, 92, tmp_path / "run2") | {"FAKE_GPUS": "8", "FAKE_NUMA": "1"}))
        assert r.returncode == 0, r.stdout + r.stderr
        (torchrun,) = fakes.calls("torchrun")
        assert option(torchrun["argv"], "--numa-binding") == "node"


@pytest.mark.parametrize("requeue", [False, True])
def test_sbatch_exits_with_the_jobs_status_and_requeues_when_asked(requeue, tmp_path):
    """torchrun exits 1 whenever a rank exits non-zero; the batch script exits with the job's own status (5: saved,
    resubmit) from RUN_DIR/exit_status, and with REQUEUE=1 requeues itself (scontrol requeue) on 5."""
    fakes = Fakes(tmp_path)
    env = slurm_env(1, 8, 91, tmp_path / "run") | {"FAKE_STATUS": "5"} | ({"REQUEUE": "1"} if requeue else {})
    one_node = ROOT / "examples" / "slurm" / "llama3_8b_upipe_8xh100.sbatch"
    r = fakes.run(one_node, **env)
    assert r.returncode == 5, r.stdout + r.stderr
    requeues = [c["argv"] for c in fakes.calls("scontrol") if c["argv"][0] == "requeue"]
    assert requeues == ([["requeue", "91"]] if requeue else [])
    r = fakes.run(one_node, **(env | {"FAKE_STATUS": "2"}))
    assert r.returncode == 2 and [c["argv"] for c in fakes.calls("scontrol") if c["argv"][0] == "requeue"] == requeues


@pytest.mark.parametrize("case", ["bad override", "wrong world size", "not under slurm", "not the repository"])
def test_sbatch_recipe_refuses_before_launching(case, tmp_path):
    fakes = Fakes(tmp_path)
    env = slurm_env(1, 8, 5, tmp_path / "run")
    overrides = ["train.stpes=3"] if case == "bad override" else []
    if case == "wrong world size":
        env["NPROC_PER_NODE"] = "4"  # cp=8 needs 8 ranks
    if case == "not under slurm":
        env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    if case == "not the repository":
        env["SLURM_SUBMIT_DIR"] = str(tmp_path)
    r = fakes.run(SBATCH[0], *overrides, **env)
    assert r.returncode != 0
    assert fakes.calls("srun") == [] and fakes.calls("torchrun") == []
    expected = {"bad override": "train.steps", "wrong world size": "world size 4", "not under slurm": "sbatch",
                "not the repository": "REPO_DIR"}[case]
    assert expected in r.stderr, r.stderr


def test_single_node_recipe(tmp_path):
    fakes = Fakes(tmp_path)
    run_dir = tmp_path / "run"
    # The GPU recipe with fake GPUs on this machine: its pre-flight --check-machine would refuse NCCL and ZeRO-1
    # without CUDA (tests/test_cli_errors.py), so those two run on gloo here.
    r = fakes.run(SINGLE_NODE, "train.steps=3", "dist.backend=gloo", "train.distributed_optimizer=false",
                  FAKE_GPUS="8", RUN_DIR=str(run_dir), EXTRA_ARGS="--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert fakes.calls("srun") == []
    (torchrun,) = fakes.calls("torchrun")
    t = torchrun["argv"]
    assert option(t, "--nnodes") == "1" and option(t, "--nproc-per-node") == "8"
    assert option(t, "--rdzv-endpoint") == "localhost:29500"
    assert t[t.index("pretrain_llama.py"):] == ["pretrain_llama.py", "--config", f"{run_dir}/config.yaml",
                                           "--status-file", f"{run_dir}/exit_status", "--dry-run"]
    assert torchrun["cwd"] == str(ROOT)
    assert torchrun["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    resolved = load_config(str(run_dir / "config.yaml"), [])
    assert resolved.train.steps == 3 and resolved.parallel.cp == 8
    assert resolved.log.metrics_file == f"{run_dir}/metrics.jsonl"
    assert resolved.checkpoint.dir == f"{run_dir}/checkpoints"  # each launch its own checkpoints


def test_single_node_recipe_on_cpu(tmp_path):
    """Without GPUs: NPROC_PER_NODE is required, and the tiny CPU config launches with the given port."""
    fakes = Fakes(tmp_path)
    r = fakes.run(SINGLE_NODE, FAKE_GPUS="0", RUN_DIR=str(tmp_path / "a"))
    assert r.returncode == 2 and "NPROC_PER_NODE" in r.stderr and fakes.calls("torchrun") == []
    r = fakes.run(SINGLE_NODE, "train.steps=3", "train.warmup_steps=1", FAKE_GPUS="0", NPROC_PER_NODE="2",
                  MASTER_PORT="29777", CONFIG="examples/configs/tiny_cpu.yaml", RUN_DIR=str(tmp_path / "b"))
    assert r.returncode == 0, r.stdout + r.stderr
    (torchrun,) = fakes.calls("torchrun")
    assert shlex.join(torchrun["argv"]).startswith(
        "--nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint localhost:29777")
    assert load_config(str(tmp_path / "b" / "config.yaml"), []).dist.backend == "gloo"


# srun of a job on several nodes, all on this machine: one copy of the command per node (--nodes), each with the
# SLURM_NODEID / SLURM_PROCID Slurm gives it, run side by side; exits with the worst code.
MULTI_NODE_SRUN = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
nodes = int(next(a.split("=", 1)[1] for a in args if a.startswith("--nodes=")))
cmd = args[next(i for i, a in enumerate(args) if not a.startswith("-")):]
procs = [subprocess.Popen(cmd, env=os.environ | {{"SLURM_NODEID": str(i), "SLURM_PROCID": str(i)}})
         for i in range(nodes)]
sys.exit(max(p.wait() for p in procs))
"""
RING_RECIPE = ROOT / "examples" / "slurm" / "llama3_8b_upipe_ring_2x8xh100.sbatch"


def test_two_node_ring_recipe_places_each_all_to_all_inside_a_node(tmp_path):
    """The 2-node hybrid recipe, run on this machine as two 'nodes' (one real torchrun each, c10d rendezvous on
    localhost) of 2 ranks: the tiny model with cp 4 = 2 (all-to-all) x 2 (ring) trains 3 steps, and every
    all-to-all group is inside one node while each ring spans both (the job's own placement line). Then the same
    launch with cp_ring=1 (one step) reports its all-to-all group of 4 spanning both nodes."""
    fakes = Fakes(tmp_path)
    (fakes.bin / "torchrun").unlink()  # the real one, from this interpreter's environment
    (fakes.bin / "srun").write_text(MULTI_NODE_SRUN.format(python=sys.executable))
    venv_bin = str(Path(sys.executable).parent)
    overrides = ["model.preset=tiny", "parallel.cp=4", "parallel.upipe_heads_per_stage=null", "train.seq_length=64",
                 "train.steps=3", "train.bf16=false", "dist.backend=gloo", "dist.timeout_s=120",
                 "memory.plan_check=false", "memory.shard_model_states=false", "memory.offload_checkpoints=false",
                 "memory.attention_grad_accum=fp32", "memory.mlp_chunks=1", "memory.loss_chunks=1",
                 f"data.path={ROOT}/data/corpus_text_document", f"data.tokenizer={ROOT}/data/tokenizer/spm.model",
                 "checkpoint.interval=0"]
    for ring, expected in (("2", "context parallel on 2 node(s): all-to-all groups of 2 ranks inside one node each; "
                                 "rings of 2 across 2 node(s)"),
                           ("1", "context parallel on 2 node(s): all-to-all groups of 4 ranks spanning up to 2 nodes")):
        run_dir = tmp_path / f"run-ring{ring}"
        env = slurm_env(2, 8, 31, run_dir) | {"NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port()),
                                              "FAKE_HOSTS": "localhost localhost",
                                              "PATH": f"{fakes.bin}:{venv_bin}:{os.environ['PATH']}"}
        steps = 3 if ring == "2" else 1  # the all-to-all across nodes: its placement line and one step
        r = fakes.run(RING_RECIPE, *overrides, f"parallel.cp_ring={ring}", f"train.steps={steps}",
                      "train.warmup_steps=0", f"checkpoint.dir={run_dir}/checkpoints", **env)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        assert expected in r.stdout, r.stdout[-4000:]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in records if x.get("kind", "train") == "train"] == list(range(1, steps + 1)), \
            r.stdout[-3000:]


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.name)
def test_sbatch_time_limit_holds_the_first_checkpoint_by_the_step_time_model(script):
    """examples/plans/recipe_step_times.json (tools/recipe_times.py: the planner's step-time model on this config at
    this world size) is current for the recipe, the first checkpoint comes within the first half of --time, and the
    header says the step time, the interval and the first checkpoint as the model gives them."""
    from megatron_upipe.training.recipe_times import (
        TIMES_FILE, config_sha256, header_lines, recipe_problems, sbatch_world_size, time_limit_s,
    )

    d = sbatch_directives(script)
    entry = json.loads((ROOT / TIMES_FILE).read_text())[script.name]
    config = config_of(script)
    assert (entry["config"], entry["world_size"]) == (str(config.relative_to(ROOT)), sbatch_world_size(d))
    assert entry["config_sha256"] == config_sha256(config), f"{TIMES_FILE} is stale: rerun tools/recipe_times.py"
    interval = load_config(str(config), []).checkpoint.interval
    limit = time_limit_s(d["--time"])
    assert recipe_problems(script.name, limit, interval, entry["step_s"]) == []
    text = script.read_text()
    for line in header_lines(entry["step_s"], interval, limit):
        assert line in text, f"{script.name}'s header must carry: {line}"


def test_the_time_rule_refuses_a_first_checkpoint_past_half_the_limit():
    from megatron_upipe.training.recipe_times import recipe_problems, time_limit_s

    assert [time_limit_s(v) for v in ("06:00:00", "1-00:00:00", "90", "30:00")] == [21600, 86400, 5400, 1800]
    step = 1.86 * 3600  # about the 8B 5M recipe's step by the model
    (problem,) = recipe_problems("x.sbatch", time_limit_s("06:00:00"), 5, step)  # the recipes' old settings
    assert "first checkpoint comes after 9.4" in problem and "lower checkpoint.interval or raise --time" in problem
    assert recipe_problems("x.sbatch", time_limit_s("06:00:00"), 1, step) == []
    assert "saves nothing" in recipe_problems("x.sbatch", 21600, 0, step)[0]
