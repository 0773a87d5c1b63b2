"""The server's checkpoint: everything a run needs to continue after its ServerApp stops.

After every round concatfl's ServerApp writes `<output-dir>/checkpoint` atomically (a reader, or
a crash half-way through writing, never leaves a partial file): the global model, the
strategy's complete state (`state_dict()`: FedCat's copies, counts and groups; FedSeq's
superclients and slots; FedConcat's stage, clusters, cluster models and head; SCAFFOLD's c,
FedDyn's h; the strategy's random generator; the per-round records), the server's torch random
state, the initial evaluation and the wall time so far. `resume=true` continues from it.

Node ids in the state are the stable ids of `concatfl.deployment.grid` (partition ids), so a
checkpoint matches the nodes of a later run, in simulation and in deployment.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_FILE = "checkpoint"
# Keys a resumed run may change: how long it runs and how it waits, not what it computes.
RESUMABLE_CHANGES = frozenset(
    {"num-server-rounds", "resume", "round-timeout", "min-available-nodes", "expected-nodes", "start-settle",
     "start-wait", "device"}
)


@dataclass
class Checkpoint:
    """The server's state after round `server_round`."""

    server_round: int
    arrays: dict[str, np.ndarray]
    strategy_state: dict[str, Any]
    initial: dict[str, float]
    torch_rng: torch.Tensor
    run_config: dict[str, Any]
    wall_seconds: float


def save_checkpoint(output_dir: str | os.PathLike, checkpoint: Checkpoint) -> Path:
    """Write `<output_dir>/checkpoint` atomically (temporary file, then rename)."""
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / CHECKPOINT_FILE
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{CHECKPOINT_FILE}-", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(vars(checkpoint), file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


def load_checkpoint(output_dir: str | os.PathLike) -> Checkpoint:
    """Read `<output_dir>/checkpoint`; a missing file fails with the path and the key to change."""
    path = Path(output_dir) / CHECKPOINT_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"resume=true but there is no checkpoint at {path}; set 'output-dir' to the folder of the "
            "run to continue, or resume=false to start afresh"
        )
    # The file holds numpy arrays and plain containers written by save_checkpoint, not only tensors.
    return Checkpoint(**torch.load(path, weights_only=False))


def check_resumable(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume under a run config that changes what the run computes."""
    changed = sorted(
        key for key in saved.keys() | current.keys() if key not in RESUMABLE_CHANGES and saved.get(key) != current.get(key)
    )
    if changed:
        details = ", ".join(f"'{key}' {saved.get(key)!r} -> {current.get(key)!r}" for key in changed)
        raise ValueError(
            f"cannot resume: the run config differs from the checkpoint's in {details}; only "
            f"{sorted(RESUMABLE_CHANGES)} may change"
        )
