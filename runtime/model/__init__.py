"""The transformer: weights, layers, attention, tokenizer, devices."""
