"""concatfl: federated learning under label skew (FedCat, FedSeq, FedConcat) on Flower."""
