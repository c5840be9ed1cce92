"""The ``python train.py`` recipe: an ESM-2-style model, its tokenizer, data and configs.

Import the submodules directly (``bert_reduce.recipe.model`` and so on); this package
imports nothing itself so that loading one part does not pull in the others.
"""

__all__: list[str] = []
