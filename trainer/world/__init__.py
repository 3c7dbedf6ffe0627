"""The tiny world: its facts and users (town), the corpus, the tokenizer and model, pretraining,
the report, simulated users. Imports only the standard library, tokenizers/torch/transformers
and itself (never proxy/, judge/ or the rest of trainer/; judge/templates are read as files)."""
