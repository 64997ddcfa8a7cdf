"""What MiCRO and ExDyna share below both: ExDyna's ``BlockLayout``, which MiCRO's control state
carries, and the format of their control state in a checkpoint (docs/architecture.md#checkpoints).

Its own module so that micro.py (MiCRO, and what the two methods share) and exdyna.py (which
builds on micro.py) import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ..errors import ConfigurationError

# ``control_state``'s shape. States saved before the key existed are format 1 too; they also
# held MiCRO's always-empty ``layout``, which is ignored.
CONTROL_FORMAT = 1


def unreadable_control_state(method: str, problem: str) -> ConfigurationError:
    """The error for a checkpoint's control state this version cannot read, naming the fix."""
    return ConfigurationError(
        f"the checkpoint's {method} control state cannot be read ({problem}): load a checkpoint "
        f"saved by hvd_sparse's {method} (control state format {CONTROL_FORMAT}), or resume with "
        "the hvd_sparse version that saved this one")


@dataclass
class BlockLayout:
    """ExDyna's partitions as runs of whole blocks (docs/algorithms.md#block-layout). The same on
    every rank, except ``own`` and ``own_count``, which only neighbour mode sets."""

    num_blocks: int
    block: int                             # elements per block
    tail: int                              # elements after the last whole block (last partition's)
    blocks: list[int] | None = None        # blocks per partition (None in neighbour mode)
    own: tuple[int, int] | None = None     # neighbour mode: (first block, blocks) owned this step
    own_count: int | None = None           # neighbour mode: this rank's count of the last step
    block_loads: np.ndarray | None = None  # histogram mode: decaying average of per-block counts

    def to_state(self) -> dict:
        """Plain data for a checkpoint: the fields that are set, as ints and lists."""
        optional = {"blocks": self.blocks, "own": self.own, "own_count": self.own_count,
                    "block_loads": self.block_loads}
        return {"num_blocks": self.num_blocks, "block": self.block, "tail": self.tail,
                **{name: np.asarray(value).tolist() for name, value in optional.items() if value is not None}}

    @classmethod
    def from_state(cls, state: dict) -> BlockLayout:
        """The inverse of ``to_state``; refuses what it did not write."""
        problems = [f"no {name}" for name in ("num_blocks", "block", "tail") if name not in state]
        problems += [f"unknown {name!r}" for name in sorted(set(state) - {f.name for f in fields(cls)})]
        if problems:
            raise unreadable_control_state("ExDyna", f"layout with {', '.join(problems)}")
        blocks, own = state.get("blocks"), state.get("own")
        own_count, loads = state.get("own_count"), state.get("block_loads")
        return cls(int(state["num_blocks"]), int(state["block"]), int(state["tail"]),
                   blocks=None if blocks is None else [int(b) for b in blocks],
                   own=None if own is None else (int(own[0]), int(own[1])),
                   own_count=None if own_count is None else int(own_count),
                   block_loads=None if loads is None else np.asarray(loads, dtype=np.float64))
