"""The defaults every YAML file of the config tree overrides, registered in Hydra's ConfigStore.

Why registered rather than written as YAML: each default has one source, the pydantic `Field`s of
the component's config (`recsys_pipe.config.structured`), so a default changed in code is the
default Hydra composes.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from recsys_pipe.cli.hydra_adapter import store_config
from recsys_pipe.cli.sweep_dir import sweep_dir

__all__ = ["DEFAULTS_GROUP", "SCHEMA_NAME", "register_schemas"]

#: Name under which the pipeline skeleton is registered; conf/config.yaml lists it first.
SCHEMA_NAME = "recsys_schema"
#: Group of the per-component defaults (see register_schemas).
DEFAULTS_GROUP = "hydra/recsys_defaults"


#: whether `register_schemas` ran in this process
_registered = False


def register_schemas() -> None:
    """Register in Hydra's ConfigStore the defaults every YAML file overrides (one source per
    default: the pydantic `Field`s, see `recsys_pipe.config.structured`), and the
    `recsys_sweep_dir` resolver. Idempotent; must run before Hydra composes conf/config.yaml.

    - `recsys_schema`: the root: the `pipeline` skeleton, the trainer's defaults, `seed`, `debug`;
    - `hydra/recsys_defaults/<section>/<name>` for every registered model, data source and
      optimizer (and `.../builder` for a user's own builder): the option files of that group list
      theirs first (`- /hydra/recsys_defaults/model/hstu@_here_`). Under `hydra/` because --help
      lists every other group as a user's choice, and these are not.
    """
    global _registered
    if _registered:  # the registries are fixed at import: the nodes would be the same (~20 ms each time)
        return
    from recsys_pipe.config import ConfigError
    from recsys_pipe.config.structured import defaults_node, root_skeleton
    from recsys_pipe.train.config import RunConfig, TrainerConfig
    from recsys_pipe.train.parallel.config import ParallelConfig

    fields = RunConfig.model_fields
    store_config(
        name=SCHEMA_NAME,
        node=root_skeleton(
            {"trainer": TrainerConfig, "parallel": ParallelConfig},
            seed=fields["seed"].default,
            debug=fields["debug"].default,
        ),
    )
    for section, registry in RunConfig.COMPONENTS.items():
        # model=custom, data=custom: the user must name their builder (??? is OmegaConf's "missing")
        store_config(
            group=f"{DEFAULTS_GROUP}/{section}", name="builder", node={**defaults_node(registry.base), "builder": "???"}
        )
        for name in registry.names:
            try:  # `builder` stays null: `name` picks it (a section sets one or the other)
                node = {**defaults_node(registry.config_class({"name": name}, section)), "builder": None}
            except ConfigError:  # cannot be imported here (e.g. no torchrec): validation says so, by path
                node = {"name": name}
            store_config(group=f"{DEFAULTS_GROUP}/{section}", name=name, node=node)
    if not OmegaConf.has_resolver("recsys_sweep_dir"):
        OmegaConf.register_new_resolver("recsys_sweep_dir", sweep_dir)
    _registered = True
