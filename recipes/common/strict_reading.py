"""Reading YAML and JSON that refuse a key written twice in one mapping (the libraries keep the last
one silently, so a file that sets a value twice would run with whichever came last). At the bottom of
recipes/common/: it imports nothing of the project."""

from __future__ import annotations


class DuplicateKey(Exception):
    """A key written twice in one mapping of a config file."""


def mapping_without_repeats(pairs) -> dict:
    keys = [key for key, _ in pairs]
    repeated = next((key for key in keys if keys.count(key) > 1), None)
    if repeated is not None:
        raise DuplicateKey(repeated)
    return dict(pairs)


def _strict_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """yaml.safe_load that refuses a key written twice in one mapping."""

    def construct_mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        return mapping_without_repeats([(loader.construct_object(key, deep=deep), loader.construct_object(value, deep=deep))
                                        for key, value in node.value])

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return Loader


StrictLoader = _strict_loader()
