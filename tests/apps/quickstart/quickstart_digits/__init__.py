"""quickstart-digits: a user's own Flower app that trains with concatfl's FedConcat."""
