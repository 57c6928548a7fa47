"""`swarmgate keys create|list|revoke|usage`: the gateway's API keys at runtime, in its state store.

Each subcommand takes `--database_url` (default: `SWARMGATE_DATABASE_URL`, else the gateway's default SQLite file;
`gateway.store.default_url`), the same store the gateways use, so that what it does is seen by every gateway sharing
it at their next request. `create NAME [--rpm N] [--tpm N] [--max_streams N]` prints the new key once, on its last
line (the store keeps only a salted hash of it); `list [--json]` shows each key's name, creation and last use, limits,
whether it is revoked and its usage (requests, prompt_tokens, cached_tokens, completion_tokens); `revoke NAME`;
`usage [NAME] [--days N] [--json]` per key, model and UTC day. Exit codes: 0 done, 1 no such key, 2 bad arguments or a
store that cannot be used (one line on stderr).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

from gateway.store import KeyLimits, StoreError, open_store, usage_totals
from gateway.store.base import day_of

_DB_HELP = ("the state store: sqlite:///PATH or redis://HOST:PORT/DB (default: $SWARMGATE_DATABASE_URL, else the "
            "gateway's default file, gateway.sqlite3 under the cache directory)")


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmgate keys", description="Create, list and revoke the gateway's API "
                                                                        "keys and read their usage.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{create,list,revoke,usage}")
    create = commands.add_parser("create", help="create a key and print it (once, on the last line)",
                                 description="Create a named key with optional limits; the key is printed once, on "
                                             "the last line: only its salted hash is stored.")
    create.add_argument("name", help="the key's name (letters, digits, '.', '_', '@', '-'; unique)")
    create.add_argument("--rpm", type=_positive, help="requests per minute (default: no limit)")
    create.add_argument("--tpm", type=_positive, help="tokens per minute, prompt plus generated (default: no limit)")
    create.add_argument("--max_streams", type=_positive, help="generations running at once (default: no limit)")
    listing = commands.add_parser("list", help="list the keys with their limits and usage",
                                  description="List the keys: name, created, last used, limits, revoked, usage.")
    listing.add_argument("--json", action="store_true", help="print one JSON array")
    revoke = commands.add_parser("revoke", help="revoke a key (refused by every gateway at its next request)",
                                 description="Revoke a key: every gateway sharing the store refuses it from its next "
                                             "request on.")
    revoke.add_argument("name", help="the key's name")
    usage = commands.add_parser("usage", help="usage per key, model and day",
                                description="Requests and tokens per key, model and UTC day.")
    usage.add_argument("name", nargs="?", help="only this key (default: every key)")
    usage.add_argument("--days", type=_positive, default=7, help="the last N days, today included (default 7)")
    usage.add_argument("--json", action="store_true", help="print one JSON array")
    for sub in (create, listing, revoke, usage):
        sub.add_argument("--database_url", default=None, help=_DB_HELP)
    return parser


def _when(t: Optional[float]) -> str:
    return "never" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        store = open_store(args.database_url)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return _run(store, args)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        store.close()


def _run(store, args) -> int:
    if args.command == "create":
        try:
            key = store.create_key(args.name, KeyLimits(args.rpm, args.tpm, args.max_streams))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"created key '{args.name}' in {store.url}; it is shown once, here:")
        print(key)
        return 0
    if args.command == "revoke":
        if not store.revoke_key(args.name):
            print(f"error: no key named {args.name!r}", file=sys.stderr)
            return 1
        print(f"revoked key '{args.name}'")
        return 0
    if args.command == "list":
        totals = usage_totals(store.usage())
        empty = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}
        keys = [{**k.as_dict(), "usage": totals.get(k.name, empty)} for k in store.list_keys()]
        if args.json:
            print(json.dumps(keys, indent=2))
            return 0
        print(f"{'NAME':20} {'CREATED':19} {'LAST USED':19} {'RPM':>6} {'TPM':>8} {'STREAMS':>7} {'REVOKED':7} "
              f"{'REQUESTS':>8} {'PROMPT':>9} {'CACHED':>9} {'COMPLETION':>10}")
        for k in keys:
            limits, used = k["limits"], k["usage"]
            print(f"{k['name']:20} {_when(k['created']):19} {_when(k['last_used']):19} "
                  f"{limits['rpm'] or '-':>6} {limits['tpm'] or '-':>8} {limits['max_streams'] or '-':>7} "
                  f"{'yes' if k['revoked'] else 'no':7} {used['requests']:>8} {used['prompt_tokens']:>9} "
                  f"{used['cached_tokens']:>9} {used['completion_tokens']:>10}")
        return 0
    since = day_of(time.time() - (args.days - 1) * 86_400)
    rows = [vars(r) for r in store.usage(args.name, since_day=since)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'DAY':10} {'KEY':20} {'MODEL':24} {'REQUESTS':>8} {'PROMPT':>9} {'CACHED':>9} {'COMPLETION':>10}")
    for r in rows:
        print(f"{r['day']:10} {r['key']:20} {r['model']:24} {r['requests']:>8} {r['prompt_tokens']:>9} "
              f"{r['cached_tokens']:>9} {r['completion_tokens']:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
