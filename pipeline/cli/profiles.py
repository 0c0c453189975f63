"""The commands on profiles, before any run: `plan` (disk, GPU memory, time), `preflight` (the checks a run
would stop at) and `schema` (the profile's JSON schema)."""
from __future__ import annotations

import json
import sys

from pipeline.cli.base import EXIT_FAILED, EXIT_USAGE, Command, overrides


class Plan(Command):
    name, help = "plan", "disk, GPU memory, time and GPU-hours of profiles, side by side"

    def subparser_init(self, subparsers):
        p = super().subparser_init(subparsers)
        p.add_argument("profiles", nargs="+", metavar="PROFILE")
        p.add_argument("--json", action="store_true")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a profile value")
        return p

    def errors(self) -> dict:
        from pipeline.data.targetinfo import TargetInfoError
        from pipeline.profile import ProfileError
        return {(ProfileError, TargetInfoError): EXIT_USAGE, **super().errors()}

    def cmd(self, args) -> int:
        from pipeline.planning import plan
        from pipeline.profile import load_profile

        profiles = [load_profile(p, overrides(args.set), check_inputs=False) for p in args.profiles]
        # planned for the box each profile is written for (its disk), not for this machine
        plans = [plan.make_plan(p, free=int(p.hardware.disk_gib * plan.GIB) if p.hardware.disk_gib else None)
                 for p in profiles]
        print(json.dumps([p.to_dict() for p in plans], indent=1) if args.json else plan.table(plans))
        return 0


class Preflight(Command):
    name, help = "preflight", "check target, versions, GPUs, port and disk before a run"

    def subparser_init(self, subparsers):
        p = super().subparser_init(subparsers)
        p.add_argument("profile")
        p.add_argument("--json", action="store_true")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a profile value")
        return p

    def errors(self) -> dict:
        from pipeline.profile import ProfileError
        return {ProfileError: EXIT_USAGE, **super().errors()}

    def cmd(self, args) -> int:
        from pipeline.planning import preflight
        from pipeline.profile import load_profile

        findings = preflight.preflight(load_profile(args.profile, overrides(args.set), check_inputs=False))
        print(preflight.to_json(findings) if args.json else "\n".join(f.line() for f in findings))
        blocked = preflight.blocking(findings)
        if blocked and not args.json:
            print(f"{len(blocked)} blocking finding(s): a run of this profile would stop here", file=sys.stderr)
        return EXIT_FAILED if blocked else 0


class Schema(Command):
    name, help = "schema", "the profile's JSON schema (for editors; docs/profile.schema.json)"

    def cmd(self, args) -> int:
        from pipeline.profile import json_schema
        sys.stdout.write(json_schema())
        return 0
