"""Train an ESM-2-style masked-language model: ``python train.py [key=value ...]``.

Configured by ``conf/`` (typed by ``bert_reduce/recipe/config.py``): see docs/recipe.md.
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from bert_reduce.recipe.build import run
from bert_reduce.recipe.config import register_configs

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Compose, instantiate, fit, validate: see :func:`bert_reduce.recipe.build.run`."""
    hydra_cfg = HydraConfig.get()
    node = hydra_cfg.sweep if hydra_cfg.mode == RunMode.MULTIRUN else hydra_cfg.run
    # The run directory's pattern, unresolved: is it made from the time (the default)?
    made_from_time = "${now:" in str(OmegaConf.to_container(node, resolve=False)["dir"])
    run(cfg, hydra_cfg.runtime.output_dir, fixed_run_dir=not made_from_time)


if __name__ == "__main__":
    main()
