"""``--tenants FILE``: the tenants file (TOML), one ``[tenants.NAME]`` table per tenant."""

from __future__ import annotations

import tomllib

from tinyserve.config import TenantConfig


def load_tenants(path: str) -> tuple[TenantConfig, ...]:
    """``--tenants FILE``: one ``[tenants.NAME]`` table per tenant (TOML)."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    tables = data.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"{path}: expected one or more [tenants.NAME] tables")
    known = set(TenantConfig.__dataclass_fields__) - {"name"}
    tenants = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: tenants.{name} must be a table ([tenants.{name}])")
        unknown = set(table) - known
        if unknown:
            raise ValueError(f"{path}: tenants.{name}: unknown keys {sorted(unknown)}")
        key = table.get("api_key")
        if not isinstance(key, str):
            raise ValueError(f"{path}: tenants.{name}.api_key is required")
        # An empty key would let in an empty "Authorization: Bearer "; HTTP trims a header's
        # value, so a key with spaces around it could never be sent
        if key != key.strip() or not key:  # (the message never shows the key)
            what = "is empty" if not key.strip() else "has spaces around it"
            raise ValueError(f"{path}: tenants.{name}.api_key {what}: give each tenant a "
                             "non-empty key with no spaces around it")
        tenants.append(TenantConfig(name=name, **table))
    keys = [t.api_key for t in tenants]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{path}: two tenants share an api_key")
    return tuple(tenants)
