"""Model builders: the built-in small causal LM and its character tokenizer."""
