"""What a user reads: the strategy summary and the run log the launcher prints (the whole log of a
real run, and its length: tests/test_e2e_foundation.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from concatfl.config import STRATEGIES, RunConfig
from concatfl.deployment.cli import colors_wanted, plain, readable_log
from concatfl.runtime import ServerEnv
from concatfl.strategies import build_strategy
from concatfl.strategies.summary import summary_value
from concatfl.strategies.common import Miss, Request


def _strategy(name: str):
    config = RunConfig.from_mapping({"strategy": name, **({"proximal-mu": 0.1} if name == "fedprox" else {})})
    return build_strategy(config, ServerEnv.from_config(config))


@pytest.mark.parametrize("name", STRATEGIES)
def test_summary_is_a_few_lines_of_parameters(name):
    lines = _strategy(name).summary_lines()
    text = "\n".join(lines)

    # The longest parameter lists (FedSeq's and FedConcat's, about 22 each) fit 6 lines of 100
    # characters; the full server environment used to take ~350.
    assert 1 <= len(lines) <= 6 and all(len(line) <= 100 for line in lines)
    assert "seed=0" in text and "round_timeout=" in text
    # never data, models or functions; never empty internal state (plans, caches, records)
    assert "tensor" not in text and "<function" not in text and "<bound method" not in text
    for internal in ("plan=", "client_samples=", "superclients=", "assignment=", "history=", "{}", "[]"):
        assert internal not in text


def test_summary_shows_parameters_of_the_class_and_its_bases():
    lines = _strategy("fedprox").summary_lines()
    assert lines[0].startswith("FedProx: proximal_mu=0.1, fraction_train=1.0, min_train_nodes=1")


def test_summary_values_are_short():
    assert summary_value(torch.zeros(360, 1, 8, 8)) == "Tensor of shape (360, 1, 8, 8)"
    assert summary_value(np.zeros((3, 4))) == "ndarray of shape (3, 4)"
    assert summary_value((1, 8, 8)) == "(1, 8, 8)"
    assert summary_value([f"layer{i}.weight" for i in range(62)]) == "<62 items>"
    assert summary_value(torch.device("cpu")) == "'cpu'"
    assert summary_value(LongRepr()) == "<LongRepr>"


class LongRepr:
    def __repr__(self) -> str:
        return "LongRepr(data=" + "0, " * 100 + ")"


# Lines of a real run log (flwr 1.42) as `flwr log --stream` prints them.
FLOWER_LOG = """\x1b[92mINFO \x1b[0m:      Starting Flower Simulation
\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.
\x1b[92mINFO \x1b[0m:      Federation `@none/default` (10 simulated SuperNodes)
\x1b[92mINFO \x1b[0m:      To change federation size, use the following command:
\x1b[92mINFO \x1b[0m:      \tflwr federation simulation-config @none/default <superlink> --num-supernodes <N>
Successfully installed concatfl to /tmp/h2demo/flwr-home/apps/concatfl.concatfl.0.1.0.835fa5ee.
\x1b[92mINFO \x1b[0m:      [ROUND 1/20] accuracy 0.2694, loss 2.2321, sent 2.24 MB, received 2.24 MB, 2.71 s
\x1b[92mINFO \x1b[0m:      final accuracy 0.9222; metrics written to /tmp/h2demo/output/metrics.json
\x1b[92mINFO \x1b[0m:      
\x1b[36m(ClientAppActor pid=2651)\x1b[0m \x1b[93mWARNING \x1b[0m:   Manually terminating ClientAppActor
"""


def test_readable_log_drops_flowers_federation_size_notice_and_keeps_progress():
    kept = list(readable_log(FLOWER_LOG.splitlines(keepends=True)))
    assert [line.split(":", 1)[1].strip() for line in kept] == [
        "Starting Flower Simulation",
        "Federation `@none/default` (10 simulated SuperNodes)",
        "[ROUND 1/20] accuracy 0.2694, loss 2.2321, sent 2.24 MB, received 2.24 MB, 2.71 s",
        "final accuracy 0.9222; metrics written to /tmp/h2demo/output/metrics.json",
    ]


# A ClientApp that raised, as Flower 1.42's simulation logs it (three ERROR records, shortened
# here from ~110 lines), then the strategy's line about the missed reply.
CLIENT_FAILURE = """\x1b[91mERROR \x1b[0m:     An exception was raised when processing a message by RayBackend
\x1b[91mERROR \x1b[0m:     \x1b[36mray::ClientAppActor.run()\x1b[39m (pid=23918, ip=192.0.2.2)
  File "/app/concatfl/data/partition.py", line 107, in partition_indices
    raise PartitionError(
concatfl.data.partition.PartitionError: partition 'dirichlet' cannot be built

The above exception was the direct cause of the following exception:

\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=23918, ip=192.0.2.2)
flwr.clientapp.client_app.ClientAppException:
Exception ClientAppException occurred. Message: partition 'dirichlet' cannot be built
\x1b[91mERROR \x1b[0m:     Traceback (most recent call last):
  File "/venv/flwr/server/superlink/fleet/vce/vce_api.py", line 132, in worker
    out_mssg, updated_context = backend.process_message(message, context)
ray.exceptions.RayTaskError(ClientAppException): \x1b[36mray::ClientAppActor.run()\x1b[39m (pid=23918)
Exception ClientAppException occurred. Message: partition 'dirichlet' cannot be built
"""
MISSED = "\x1b[93mWARNING \x1b[0m:   Node 3 (None) left out: error reply: Exception ClientAppException occurred.\n"


def test_readable_log_shortens_each_clientapp_failure_to_one_line():
    log = (FLOWER_LOG.splitlines(keepends=True)[:3] + CLIENT_FAILURE.splitlines(keepends=True) * 2
           + [MISSED, MISSED] + FLOWER_LOG.splitlines(keepends=True)[6:7] + CLIENT_FAILURE.splitlines(keepends=True))
    kept = list(readable_log(log))
    failure_line = (
        "\x1b[91mERROR \x1b[0m:     ClientApp error (traceback left out): Exception ClientAppException "
        "occurred. Message: partition 'dirichlet' cannot be built\n"
    )
    assert kept == [
        FLOWER_LOG.splitlines(keepends=True)[0],
        FLOWER_LOG.splitlines(keepends=True)[2],
        failure_line,
        failure_line,
        MISSED,
        MISSED,
        FLOWER_LOG.splitlines(keepends=True)[6],
        failure_line,  # a failure at the very end of the log
    ]


def test_colours_only_for_a_terminal_and_never_under_no_color(monkeypatch):
    class Stream(io.StringIO):
        def __init__(self, tty: bool) -> None:
            super().__init__()
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert colors_wanted(Stream(True)) and not colors_wanted(Stream(False))
    monkeypatch.setenv("NO_COLOR", "1")
    assert not colors_wanted(Stream(True))
    assert plain(MISSED) == "WARNING :   Node 3 (None) left out: error reply: Exception ClientAppException occurred.\n"


def test_a_missed_reply_is_logged_in_one_line_and_recorded_in_full():
    traceback = (
        "error reply: <class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run()\n"
        '  File "concatfl/runtime.py", line 60, in _partitions\n'
        "    partition_indices(\n"
        "Exception ClientAppException occurred. Message: partition 'dirichlet' cannot be built'>"
    )
    miss = Miss(Request(7, None), traceback)
    assert miss.short_reason == (
        "error reply: Exception ClientAppException occurred. Message: partition 'dirichlet' cannot be built"
    )
    assert miss.as_record()["reason"] == traceback
    assert Miss(Request(7, None), "no reply before the round timeout").short_reason == "no reply before the round timeout"
