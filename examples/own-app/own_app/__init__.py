"""own-app: a Flower app with its own model and ClientApp that trains with concatfl's strategies."""
