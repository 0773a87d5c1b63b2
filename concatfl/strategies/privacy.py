"""Flower's differential-privacy pieces around concatfl's strategies: which compose, which are
refused, and why (docs/privacy.md has the table).

Flower offers central DP as strategy wrappers (`flwr.serverapp.strategy`:
`DifferentialPrivacyServerSideFixedClipping`, `…ClientSideFixedClipping`,
`…ServerSideAdaptiveClipping`, `…ClientSideAdaptiveClipping`) and clipping or local DP as
ClientApp mods (`flwr.clientapp.mod`: `fixedclipping_mod`, `adaptiveclipping_mod`,
`LocalDpMod`). A wrapper's `start` is Flower's round loop: each round it calls the wrapped
strategy's `configure_train` once, sends what it returns, clips every ArrayRecord of every reply
against the arrays it passed to `configure_train` (server-side) or leaves the clipping to the
clients' mod (client-side, with the clipping norm in the train config), calls `aggregate_train`
once and adds Gaussian noise of standard deviation z·C/m to the model it returns.

That mechanism fits a round that is one broadcast of the global model and one average of the
replies to it: concatfl's FedAvg and FedProx with the mean aggregation and without FedDyn. Every
other combination is refused (`check_driver`) when the wrapper first calls `configure_train`,
before any message exists, with a `ValueError` that names the strategy, the wrapper, the reason
and what works instead (`refusal`).

The mods run in the ClientApp, which the server cannot inspect: a mod that cannot handle a
message answers with an error (Flower's own behaviour). concatfl's strategies treat that reply as
a miss, like any error, and log once per run and kind what the mod's error means for the strategy
and what works instead (`explain_mod_errors`).

With a client-side wrapper the server relies on the clients' mod to clip. A reply whose update
is longer than the clipping norm the wrapper sent (a ClientApp without the mod) is clipped by the
server instead (`clip_update`), and the first such reply is logged (`enforce_clipping`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from logging import WARNING

import numpy as np
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)
from flwr.supercore import log
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from .common import ARRAYS_KEY, Miss, Reply, to_numpy, without

SERVER_SIDE = (DifferentialPrivacyServerSideFixedClipping, DifferentialPrivacyServerSideAdaptiveClipping)
CLIENT_SIDE = (DifferentialPrivacyClientSideFixedClipping, DifferentialPrivacyClientSideAdaptiveClipping)
WRAPPERS = (*SERVER_SIDE, *CLIENT_SIDE)
DP_MODS = ("fixedclipping_mod", "adaptiveclipping_mod", "LocalDpMod")
MOD_FOR = {
    DifferentialPrivacyClientSideFixedClipping: "fixedclipping_mod",
    DifferentialPrivacyClientSideAdaptiveClipping: "adaptiveclipping_mod",
}
DOCS = "docs/privacy.md"
# How many calling frames `driving_wrapper` looks at (Flower's wrappers call `configure_train`
# directly: three frames above `driving_wrapper`, through `check_driver`).
_FRAMES = 6
# A reply's update may exceed the clipping norm by this relative margin (float32 rounding) before
# the server clips it itself.
CLIP_TOLERANCE = 1e-4

LOCAL_DP = (
    "Flower's LocalDpMod on the ClientApp's train handler (`@app.train(mods=[LocalDpMod(...)])`: "
    "every reply, each hop's included, is clipped and noised on the client before it leaves)"
)
WRAPPED_FEDAVG = "concatfl's FedAvg or FedProx under this wrapper"


@dataclass
class PrivacyState:
    """What a strategy knows about the DP pieces around it during a run."""

    wrapper: Strategy | None = None  # the Flower DP wrapper driving it, if any
    clipping_norm: float | None = None  # the norm a client-side wrapper put into the last train config
    clipped: list[int] = field(default_factory=list)  # nodes whose replies the server clipped for that norm
    explained: dict[str, str] = field(default_factory=dict)  # the mod errors explained in the log, by kind
    warned: bool = False  # the guard's note under a wrapper was logged


def driving_wrapper(strategy: Strategy) -> Strategy | None:
    """The Flower strategy wrapper whose method called one of `strategy`'s, or None.

    A wrapper is a Flower `Strategy` other than `strategy` that holds it as its `strategy`
    attribute (Flower's DP wrappers do), found as `self` in one of the calling frames (the
    wrapper hands nothing else to the strategy it wraps).
    """
    frame = sys._getframe(1)  # pylint: disable=protected-access
    for _ in range(_FRAMES):
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if isinstance(caller, Strategy) and caller is not strategy and getattr(caller, "strategy", None) is strategy:
            return caller
        frame = frame.f_back
    return None


def strategy_name(strategy: Strategy) -> str:
    """The name docs and messages use: SCAFFOLD, FedConcat-ID, or the class name."""
    name = type(strategy).__name__
    if name == "Scaffold":
        return "SCAFFOLD"
    if getattr(strategy, "label_inference", False):
        return f"{name}-ID"
    return name


def refusal(strategy: Strategy, wrapper: Strategy) -> str | None:
    """Why `strategy` cannot run under Flower's DP `wrapper` and what works instead, or None when
    it can (concatfl's FedAvg and FedProx with the mean and without FedDyn)."""
    # Imported here: this module is imported by `base`, which every strategy module imports.
    from .fedavg import FedAvg  # pylint: disable=import-outside-toplevel

    wrapped = f"{strategy_name(strategy)} under Flower's {type(wrapper).__name__} is refused: "
    if isinstance(strategy, FedAvg):
        if strategy.aggregation.method != "mean":
            return wrapped + (
                f"aggregation={strategy.aggregation.method!r}. The wrapper's noise (standard deviation "
                "z·C/m) is calibrated for the mean of m clipped updates; a robust rule can move by a whole "
                "clipped update when one client's data changes. Use aggregation='mean' under the wrapper."
            )
        if strategy.feddyn is not None:
            return wrapped + (
                "FedDyn's server correction h accumulates the un-noised averages of every earlier round into "
                "the model the wrapper releases, beyond what its noise covers. Use FedAvg or FedProx without "
                "FedDyn under the wrapper."
            )
        return None
    reason, instead = _family_refusal(strategy)
    return wrapped + f"{reason} What works instead: {instead} ({DOCS})."


def _family_refusal(strategy: Strategy) -> tuple[str, str]:
    """(reason, alternative) for a strategy other than FedAvg/FedProx."""
    kind = type(strategy).__name__
    family = {cls.__name__ for cls in type(strategy).__mro__}
    if "Scaffold" in family:
        return (
            "SCAFFOLD's messages carry two ArrayRecords (the model and the control variate) and its replies "
            "are model deltas, while the wrapper clips every ArrayRecord of a reply as a model against the "
            "global model it sent, and Flower's client-side mods take exactly one ArrayRecord.",
            f"{WRAPPED_FEDAVG}; no Flower DP piece composes with SCAFFOLD",
        )
    if "FedCat" in family:
        return (
            "FedCat's devices train copies of the model that move away from the global one during a K-round "
            "cycle, and each copy goes on to the next device as the previous device returned it. The "
            "wrapper clips against the global model and adds noise once, to the average at the end of the "
            "cycle: the next device would see the previous device's update without noise.",
            f"{LOCAL_DP}, or {WRAPPED_FEDAVG}",
        )
    if "FedSeq" in family:
        return (
            f"a {kind} round is a chain of hops in which each client trains the model the previous client "
            "returned, forwarded by the server without noise, and stage 1 sends the server every client's "
            "pre-trained model to group them. The wrapper drives one message per node per round, clips "
            "against the global model and adds noise only to the round's average.",
            f"{LOCAL_DP}, or {WRAPPED_FEDAVG}",
        )
    if "FedConcat" in family:
        return (
            f"{kind} trains one model per cluster (the wrapper would clip them against the concatenated "
            "model it is returned, whose keys differ), and its stage 1 and classifier rounds use messages "
            "of their own (label distributions, features, head updates) that the wrapper cannot clip.",
            "FedConcat's own dp_epsilon (run config fedconcat-dp-epsilon) for the label distributions and "
            "Flower's LocalDpMod on the ClientApp's train and head handlers (`@app.train(mods=[...])`, "
            "`@app.train(HEAD_ACTION, mods=[...])`) for the models",
        )
    return (
        f"{kind} is not a strategy whose round is one broadcast of the global model and one average of "
        "the replies, the only kind the wrapper's clipping and noise protect.",
        f"{LOCAL_DP}, or {WRAPPED_FEDAVG}",
    )


def check_driver(strategy: Strategy, state: PrivacyState, config: ConfigRecord) -> None:
    """Called by `configure_train` before it builds any message: note the Flower DP wrapper that
    drives `strategy` (if any) and raise ValueError when the two do not compose (`refusal`)."""
    wrapper = driving_wrapper(strategy)
    if wrapper is not None and not isinstance(wrapper, WRAPPERS):
        wrapper = None  # a wrapper of the user's own: not ours to judge
    state.wrapper = wrapper
    state.clipping_norm = None
    if wrapper is None:
        return
    problem = refusal(strategy, wrapper)
    if problem is not None:
        raise ValueError(problem)
    if isinstance(wrapper, CLIENT_SIDE):
        norm = config.get(KEY_CLIPPING_NORM)
        state.clipping_norm = float(norm) if isinstance(norm, (int, float)) else None
    bounds = getattr(strategy, "update_clip", 0) > 0 or getattr(strategy, "weight_clip", 0) > 0
    if bounds and not state.warned:
        state.warned = True
        log(
            WARNING,
            "%s under %s: concatfl's reply bounds (update_clip=%s, weight_clip=%s) can scale a reply by the "
            "lengths and weights of other replies, which the wrapper's noise calibration does not cover; with "
            "update_clip=0 and weight_clip=0 the aggregate is the weighted mean of the clipped updates the "
            "wrapper assumes (%s)",
            strategy_name(strategy), type(wrapper).__name__, getattr(strategy, "update_clip", None),
            getattr(strategy, "weight_clip", None), DOCS,
        )


# ---------------------------------------------------------------------- clipping for client-side wrappers
def clip_update(
    sent: dict[str, np.ndarray], returned: dict[str, np.ndarray], norm: float
) -> tuple[dict[str, np.ndarray], float]:
    """`returned` with its update (returned − sent, over every array) scaled to L2 length at most
    `norm`, as Flower's `compute_clip_model_update` does, and the update's length before.

    Each array keeps its dtype (integer arrays, such as BatchNorm's counters, are rounded)."""
    if norm <= 0:
        raise ValueError(f"the clipping norm must be positive, got {norm}")
    updates = {key: returned[key].astype(np.float64) - sent[key].astype(np.float64) for key in returned}
    length = float(np.sqrt(sum(float(np.sum(update**2)) for update in updates.values())))
    if length <= norm:
        return dict(returned), length
    factor = norm / length
    clipped = {}
    for key, update in updates.items():
        value = sent[key].astype(np.float64) + factor * update
        dtype = returned[key].dtype
        clipped[key] = (np.rint(value) if np.issubdtype(dtype, np.integer) else value).astype(dtype)
    return clipped, length


def enforce_clipping(strategy: Strategy, state: PrivacyState, replies: list[Reply]) -> list[Reply]:
    """Under a client-side wrapper: each reply whose update is longer than the clipping norm the
    wrapper sent (its ClientApp runs no clipping mod) clipped to it by the server; the first such
    reply of the run is logged. Other replies are returned as they are."""
    norm = state.clipping_norm
    if norm is None or state.wrapper is None:
        return replies
    kept = []
    for reply in replies:
        template = reply.request.template()
        if template is None:
            kept.append(reply)
            continue
        clipped, length = clip_update(to_numpy(template), reply.numpy(), norm)
        if length <= norm * (1 + CLIP_TOLERANCE):
            kept.append(reply)
            continue
        if not state.clipped:
            log(
                WARNING,
                "%s under %s: node %s sent an update of length %.4g, above the clipping norm %.4g the wrapper "
                "sent; its ClientApp does not run Flower's %s. The server clips such replies itself (the "
                "wrapper's noise assumes clipped updates); add the mod to the ClientApp's train handler (%s)",
                strategy_name(strategy), type(state.wrapper).__name__, reply.node_id, length, norm,
                MOD_FOR.get(type(state.wrapper), "clipping mod"), DOCS,
            )
        state.clipped.append(reply.node_id)
        content = without(reply.content, ARRAYS_KEY)
        kept.append(replace(reply, content=content, decoded={**reply.decoded, ARRAYS_KEY: clipped}))
    return kept


# ---------------------------------------------------------------------- the mods' errors
def mod_error(reason: str) -> str | None:
    """The Flower DP mod named in an error reply's reason, or None."""
    return next((mod for mod in DP_MODS if f"{mod} " in reason), None)


def mod_explanation(strategy: Strategy, reason: str) -> tuple[str, str] | None:
    """(kind, explanation) of an error reply that one of Flower's DP mods gave, or None for any
    other error."""
    mod = mod_error(reason)
    if mod is None:
        return None
    name = strategy_name(strategy)
    if KEY_CLIPPING_NORM in reason and "requires the key" in reason:
        wrapper = (
            "DifferentialPrivacyClientSideFixedClipping" if mod == "fixedclipping_mod"
            else "DifferentialPrivacyClientSideAdaptiveClipping"
        )
        from .fedavg import FedAvg  # pylint: disable=import-outside-toplevel

        instead = (
            f"wrap {name} in Flower's {wrapper}, which sends the norm"
            if isinstance(strategy, FedAvg)
            else f"{name} does not compose with {wrapper} ({DOCS}); take {mod} off and use LocalDpMod instead"
        )
        return f"{mod}:norm", (
            f"the ClientApps run Flower's {mod}, which needs the clipping norm that {wrapper} puts into the "
            f"train config, and {name} is not run under that wrapper: {instead}"
        )
    if "found 2 ArrayRecord" in reason or "found 3 ArrayRecord" in reason:
        return f"{mod}:records", (
            f"the ClientApps run Flower's {mod}, which takes exactly one ArrayRecord, and {name}'s messages carry "
            f"more (SCAFFOLD: the model and the control variate): no Flower DP mod composes with {name}; use "
            f"{WRAPPED_FEDAVG.replace(' under this wrapper', '')} with the mod"
        )
    if "found 0 ArrayRecord" in reason:
        return f"{mod}:no-model", (
            f"the ClientApps run Flower's {mod} on a message or reply without a model (a query, FedConcat's "
            f"feature broadcast or an evaluation): register the mod on the train handlers that return a model, "
            f"`@app.train(mods=[...])` (and FedConcat's head handler), not on the whole ClientApp"
        )
    return f"{mod}:other", f"the ClientApps' Flower {mod} refused a message: {reason.splitlines()[-1]}"


def explain_mod_errors(strategy: Strategy, state: PrivacyState, misses: Iterable[Miss]) -> None:
    """Log, once per run and kind, what an error reply from one of Flower's DP mods means for
    `strategy` and what works instead (the reply itself is a miss like any error)."""
    for miss in misses:
        explained = mod_explanation(strategy, miss.reason)
        if explained is None or explained[0] in state.explained:
            continue
        state.explained[explained[0]] = explained[1]
        log(WARNING, "%s: node %s's reply is an error: %s (%s)", strategy_name(strategy), miss.request.node_id,
            explained[1], DOCS)



def stage_failure(error: RuntimeError, state: PrivacyState) -> RuntimeError | None:
    """A strategy's stage 1 that failed (no usable reply at all) as an error that also says what
    the DP mods' error replies meant, or None when there were none."""
    if not state.explained:
        return None
    return RuntimeError(f"{error}. The replies were errors of Flower's DP mods: {'; '.join(state.explained.values())}")
