"""Untrusted configuration read at start-up: the tenants file's keys and --speculative-config's
JSON. Each refusal is a ValueError naming the file or flag, the field and the value (the CLI
prints it and exits 2, never a traceback)."""

import math
import subprocess
import sys

import pytest

from tinyserve.api.auth import find_tenant
from tinyserve.cli.tenants import load_tenants
from tinyserve.cli.values import parse_speculative_config
from tinyserve.config import TenantConfig

# -- the tenants file --------------------------------------------------------------------------


@pytest.mark.parametrize("key", ['""', '" "', '"\\t\\n"', '" ka"', '"ka "'])
def test_a_tenant_key_that_is_empty_or_padded_is_refused_naming_file_and_tenant(tmp_path, key):
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.a]\napi_key = "ka"\n[tenants.open]\napi_key = {key}\n')
    with pytest.raises(ValueError, match=r"tenants\.toml: tenants\.open\.api_key") as e:
        load_tenants(str(path))
    assert "ka" not in str(e.value).replace("tenants.toml", "")  # the message shows no key


def test_a_tenant_that_is_not_a_table_is_refused(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text('tenants.a = 5\n')
    with pytest.raises(ValueError, match=r"tenants\.a must be a table"):
        load_tenants(str(path))


@pytest.mark.parametrize("header", ["Bearer ", "Bearer", "Bearer   ", "", "bearer \t"])
def test_an_empty_bearer_token_is_no_tenant(header):
    """Even a tenant list built without the file's checks never matches an empty token."""
    tenants = (TenantConfig("a", "ka"), TenantConfig("b", ""))
    assert find_tenant(tenants, header) is None
    assert find_tenant(tenants, "Bearer ka").name == "a"


# -- --speculative-config ---------------------------------------------------------------------


@pytest.mark.parametrize("field,value,needle", [
    ("num_speculative_tokens", '"4"', "an integer, got '4'"),
    ("num_speculative_tokens", "null", "an integer, got None"),
    ("num_speculative_tokens", "4.5", "an integer, got 4.5"),
    ("num_speculative_tokens", "true", "an integer, got True"),
    ("prompt_lookup_max", '"8"', "an integer, got '8'"),
    ("prompt_lookup_min", "[2]", "an integer, got [2]"),
    ("disable_by_batch_size", "2.0", "an integer, got 2.0"),
    ("disable_by_batch_size", "0", ">= 1, got 0"),
    ("min_acceptance", '"0.5"', "a finite number, got '0.5'"),
    ("min_acceptance", "null", "a finite number, got None"),
    ("min_acceptance", "false", "a finite number, got False"),
    ("min_acceptance", "1e999", "a finite number, got inf"),
    ("min_acceptance", "1.5", "in [0, 1), got 1.5"),
    ("method", "4", "a string, got 4"),
    ("method", "null", "a string, got None"),
    ("model", "7", "a string or null, got 7"),
    ("quantization", "8", "a string or null, got 8"),
    ("quantization", '"fp8"', "got 'fp8'"),
])
def test_each_speculative_field_is_type_checked_naming_field_and_value(field, value, needle):
    with pytest.raises(ValueError) as e:
        parse_speculative_config(f'{{"{field}": {value}}}')
    assert f"speculative_config.{field}" in str(e.value) and needle in str(e.value), str(e.value)


def test_good_speculative_configs_still_parse():
    spec = parse_speculative_config('{"num_speculative_tokens": 3, "min_acceptance": 0}')
    assert spec.num_speculative_tokens == 3 and spec.min_acceptance == 0.0
    assert type(spec.min_acceptance) is float and math.isfinite(spec.min_acceptance)
    draft = parse_speculative_config('{"method": "draft_model", "model": "/m", '
                                     '"quantization": "int4", "min_acceptance": 0.25}')
    assert draft.quantization == "int4" and draft.min_acceptance == 0.25


def test_the_command_line_says_what_is_wrong_and_exits_2():
    out = subprocess.run([sys.executable, "-m", "tinyserve", "--speculative-config",
                          '{"num_speculative_tokens": "4"}'], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert "speculative_config.num_speculative_tokens" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("key", ["", "   ", " key", "key\t"])
def test_an_empty_or_padded_api_key_is_refused(key):
    """--api-key "$UNSET" must not open the server to everyone."""
    from tinyserve.config import ServerConfig

    with pytest.raises(ValueError, match="api_key is empty or has spaces around it"):
        ServerConfig(api_key=key)
    assert ServerConfig(api_key="k").tenant_list[0].api_key == "k"
