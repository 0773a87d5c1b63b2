"""concatfl: federated learning under label skew (FedCat, FedSeq, FedConcat) on Flower."""

from pathlib import Path

# The folder of concatfl's own Flower app (its pyproject.toml): what `flwr run` submits by default.
PROJECT_DIR = Path(__file__).resolve().parents[1]
