"""Messages beyond ordinary training: FedConcat's action names, record keys and config keys, and the
identity query the ServerApp asks every node once (`concatfl.deployment.grid`).

Both sides import these constants: the server strategy (`concatfl.strategies.fedconcat`) and
the client handlers (`concatfl.fedconcat_client`). FedConcat-ID's stage 1 and both variants'
stage 2 are ordinary ``"train"`` messages (``"arrays"`` in; ``"arrays"`` + ``"metrics"`` with
``"num-examples"`` out). The rest:

``"query.fedconcat_labels"`` — stage 1-A, the label distribution
    in:  ``"config"``: {``"fedconcat-dp-epsilon"``: ε (0 = no noise)}
    out: ``"metrics"``: {``"label-distribution"``: [P(y=0), …, P(y=m-1)]} and nothing else (not
    even N, which with P would give the label counts). With ε > 0 each entry gets Laplace(0, 1/ε)
    noise drawn from the OS's entropy, never from a seed the server knows (the server could
    otherwise subtract the noise).

``"train.fedconcat_features"`` — stage 3, the one broadcast of the frozen encoders
    in:  ``"encoders"``: ArrayRecord with the ConcatModel's ``encoders.<k>.*`` weights (under a
         key other than ``"arrays"`` because the reply returns no model);
         ``"config"``: {``"model"``: concatfl architecture name (``""`` for a user's own model),
         ``"num-encoders"``: K, ``"encoders-id"``: a fingerprint of the weights,
         ``"fedconcat-head"``: the name of the run model's head layer (FedConcat's `head`)}.
    The client splits models of the run's architecture into encoder and head as the server
    did, computes the concatenated features of its whole training split once (encoders in eval
    mode, no augmentation), keeps features, labels and the fingerprint in ``context.state`` and
    answers ``"metrics"``: {``"num-examples"``: N, ``"feature-dim"``: K·d}.

``"train.fedconcat_head"`` — stage 3, one classifier round
    in:  ``"arrays"``: the ConcatModel's classifier (``classifier.weight``, ``classifier.bias``,
         whatever the run model's head is called);
         ``"config"``: {``"encoders-id"``, ``"fedconcat-classifier-steps"``, ``"lr"``,
         ``"batch-size"``, ``"momentum"``, ``"weight-decay"``, ``"server-round"``}; a missing
         hyperparameter falls back to the run config (then concatfl's default), as for
         ordinary training.
    out: ``"arrays"``: the classifier after that many SGD steps on the cached features,
         ``"metrics"``: {``"num-examples"``: N, ``"train-loss"``}.
    Cache miss (state lost on a restart, or cached for other encoders): the reply carries the
    classifier unchanged and ``"metrics"``: {``"num-examples"``: N, ``"fedconcat-cache-miss"``: 1};
    the server then sends the encoders again. The echo keeps the reply valid for the shared
    reply validation (which requires the model that was sent) and costs one classifier upload.

`concatfl.fedconcat_client` implements the three handlers and shows how a ClientApp registers
them.
"""

from __future__ import annotations

from flwr.app import MessageType

# Message types: Flower routes "<category>.<action>" to @app.<category>("<action>"); named actions
# leave a ClientApp's default query/train handlers free for other uses.
LABELS_ACTION = "fedconcat_labels"
FEATURES_ACTION = "fedconcat_features"
HEAD_ACTION = "fedconcat_head"
LABELS_MESSAGE_TYPE = f"{MessageType.QUERY}.{LABELS_ACTION}"
FEATURES_MESSAGE_TYPE = f"{MessageType.TRAIN}.{FEATURES_ACTION}"
HEAD_MESSAGE_TYPE = f"{MessageType.TRAIN}.{HEAD_ACTION}"

# Record and config keys.
ENCODERS_KEY = "encoders"
LABEL_DISTRIBUTION = "label-distribution"
DP_EPSILON = "fedconcat-dp-epsilon"
MODEL_NAME = "model"
NUM_ENCODERS = "num-encoders"
ENCODERS_ID = "encoders-id"
HEAD_NAME = "fedconcat-head"
CLASSIFIER_STEPS = "fedconcat-classifier-steps"
FEATURE_DIM = "feature-dim"
CACHE_MISS = "fedconcat-cache-miss"

# The identity query: ``"query"`` with ``"config"``: {"query": IDENTITY_QUERY}, answered with
# ``"metrics"``: {PARTITION_ID_KEY: the node's partition id}.
IDENTITY_QUERY = "identity"
PARTITION_ID_KEY = "partition-id"
