"""Hugging Face model folders: read config.json (`config`), the weights (`weights`, `dtypes`), the tokenizer
and generation_config.json (`tokenizer`, `generation`), EAGLE heads (`draft`); `load` builds targets and
heads from them, `save` writes them back."""
