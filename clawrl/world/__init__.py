"""The tiny world: its facts and users (town), the corpus, the tokenizer and model, pretraining,
its training recipe (recipe.py, written into every model it builds), the report, simulated
users. Imports only the standard library, tokenizers/torch/transformers and itself
(judge/templates are read as files)."""
