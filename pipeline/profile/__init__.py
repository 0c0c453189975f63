"""Profiles: TOML files with `extends` inheritance, validated into frozen pydantic models. One job a module:

- schema: the sections and `Profile` (types, bounds, defaults, the rules tying keys together) and the JSON
  schema generated from them;
- load: the TOML read with `extends` and `--set` overrides, input paths resolved against the profile's
  directory (`load_profile`), and a resolved profile written back (`dump_toml`);
- errors: `ProfileError`, and a validation error rendered as one line naming the file, the dotted key and
  the offending value.

The rest of the code imports from here (the names below), not from the modules.
"""
from pipeline.profile.errors import ProfileError
from pipeline.profile.load import PROFILES_DIR, dump_toml, load_profile
from pipeline.profile.schema import (
    GREEDY,
    DataSection,
    DataSource,
    DemoTargetSection,
    Positive,
    Profile,
    Section,
    TrainSection,
    json_schema,
    rule,
    source_kind,
)

__all__ = ["GREEDY", "PROFILES_DIR", "DataSection", "DataSource", "DemoTargetSection", "Positive", "Profile",
           "ProfileError", "Section", "TrainSection", "dump_toml", "json_schema", "load_profile", "rule",
           "source_kind"]
