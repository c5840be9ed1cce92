"""Train an ESM-2-style masked-language model: ``python train.py [key=value ...]``.

With no argument, a tiny model trains on the built-in synthetic protein corpus for a few
minutes on CPU. The configuration lives in ``conf/`` (typed by
``bert_reduce/recipe/config.py``); the run directory (``outputs/<date>/<time>`` or
``hydra.run.dir=...``) receives ``metrics.csv``, ``checkpoints/``, ``config.yaml`` and
``curves.png``. See docs/recipe.md.
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from bert_reduce.recipe.build import run
from bert_reduce.recipe.config import register_configs

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Compose, instantiate, fit, validate: see :func:`bert_reduce.recipe.build.run`."""
    run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
