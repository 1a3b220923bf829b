"""Replacing a piece of the UPipe op in a test (a spy, a broken all-to-all): the op's code spans the
attention/upipe*.py modules, so a name is replaced in every one of them that holds it, and put back afterwards."""

from __future__ import annotations

import contextlib

from megatron_upipe.attention import (upipe, upipe_indices, upipe_passes, upipe_pipelined, upipe_rows, upipe_serial,
                                      upipe_stages)

OP_MODULES = (upipe, upipe_rows, upipe_indices, upipe_stages, upipe_passes, upipe_serial, upipe_pipelined)


@contextlib.contextmanager
def replaced(**values):
    """`with replaced(seq_to_head=fake): ...`: each name replaced in every op module that has it."""
    saved = [(m, name, vars(m)[name]) for name in values for m in OP_MODULES if name in vars(m)]
    missing = set(values) - {name for _, name, _ in saved}
    assert not missing, f"no UPipe op module has {sorted(missing)}"
    for m, name, _ in saved:
        setattr(m, name, values[name])
    try:
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)
