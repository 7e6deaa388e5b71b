"""One source of defaults: where one YAML of rltrain/configs is the only config of a class, the
class's signature defaults are that YAML's values (or the parameter has no default)."""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path

from hydra.utils import get_object
from omegaconf import OmegaConf

from tests.conftest import CONFIGS


def nodes_with_a_target(node, where: str) -> Iterator[tuple[str, dict]]:
    if isinstance(node, dict):
        if "_target_" in node:
            yield where, node
        for key, value in node.items():
            yield from nodes_with_a_target(value, f"{where}.{key}")


def plain(value):
    """Defaults and YAML values in one form: tuples as lists, read-only mappings as dicts."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def test_a_class_configured_by_one_yaml_has_that_yamls_values_as_its_defaults():
    places = defaultdict(list)
    for path in sorted(Path(CONFIGS).rglob("*.yaml")):
        if "hydra" in path.relative_to(CONFIGS).parts:  # Hydra's own plugin configs
            continue
        tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        for where, node in nodes_with_a_target(tree, path.relative_to(CONFIGS).as_posix()):
            places[node["_target_"]].append((where, node))
    checked, mismatches = 0, []
    for target, [*found] in places.items():
        if len(found) != 1:  # e.g. GymnasiumBatchedEnv, configured by every env/*.yaml
            continue
        where, node = found[0]
        params = inspect.signature(get_object(target)).parameters  # a class, or a reward function
        for key, value in node.items():
            if key.startswith("_") or key not in params or params[key].default is inspect.Parameter.empty:
                continue
            checked += 1
            if plain(params[key].default) != plain(value):
                mismatches.append(f"{where}.{key}: the YAML says {value!r}, {target} defaults to "
                                  f"{params[key].default!r}")
    assert checked > 50  # every algo, network, collector, sync scheme, logger and hook was compared
    assert not mismatches, "\n".join(mismatches)
