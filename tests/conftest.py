"""Shared fixtures: the bundled model checkpoint, a bootstrap peer, swarms of real server processes.

Processes are started by `launch.topology` with one intra-op thread each (`threads=1`): the tests share two
cores with them."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from launch.topology import LOG_DIR_ENV, start_bootstrap, start_servers, terminate_all

# session-scoped fixtures shared by the test modules, registered here, once: the LoRA adapters and their peft
# reference (tests/fixtures/lora_fixtures.py), the bundled model quantized by transformers
# (tests/fixtures/quant_reference.py), the processes (tests/fixtures/shared_processes.py)
from tests.fixtures.lora_fixtures import lora_adapters, lora_reference  # noqa: F401
from tests.fixtures.quant_reference import bundled_quantized  # noqa: F401
from tests.fixtures.shared_processes import quiet_swarm, shared_gateways  # noqa: F401

MODEL = "smollm2-135m-instruct"

# What this test session (each xdist worker: its own) writes outside pytest's tmp_path lives in one directory, removed
# at the end of a session whose tests all passed (kept after a failure, for its process logs): the logs of the
# processes the fixtures start (`launch.topology.LOG_DIR_ENV`, unless the caller chose a directory), and the state
# (gateway.store) of the gateways the tests start (processes and in-process apps), never in the user's cache
# directory (whose API keys would turn authentication on)
SESSION_DIR = tempfile.mkdtemp(prefix="swarmgate-tests-")
os.environ.setdefault(LOG_DIR_ENV, os.path.join(SESSION_DIR, "logs"))
os.environ["SWARMGATE_DATABASE_URL"] = f"sqlite:///{SESSION_DIR}/gateway.sqlite3"

# With parallel workers (pytest-xdist, `make test`), each worker's processes take CPU turns among themselves
# (swarm.runtime.cpu_turns): with one thread each, the workers' swarms compute side by side on the two cores instead
# of waiting for each other through one machine-wide lock
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("SWARMGATE_CPU_TURNS_DOMAIN", f"pytest-{os.getpid()}-{os.environ['PYTEST_XDIST_WORKER']}")

# The servers under test run on the same two cores: one intra-op thread in the test process avoids
# oversubscription (the reference model is about 10x slower with two threads under that load).
torch.set_num_threads(1)


# Every fixture that starts block servers or gateways depends on `bootstrap`: a test that needs it is `slow`,
# so that `pytest -m "not slow"` is the fast loop (pure code, single layers, local models) while `make test`
# runs everything but the `extended` tier.
PROCESS_FIXTURES = {"bootstrap"}

# The extended tier (`make test-extended`, about 10 minutes): the long scenarios and the extra variants of cases
# that `make test` already covers once, so that `make test` stays well under 15 minutes on 2 cores. Each entry is a
# node id prefix, with what still covers its ground in `make test`.
EXTENDED = (
    # 256 concurrent gateway streams in engine rounds (make test: 64 of them, the same test with a smaller crowd)
    "tests/gateway/test_engine_round.py::test_256_concurrent_streams_complete",
    # a server frozen under engine rounds, failed by the liveness pings (about 20 s: 5 s late + a 10 s ping; make test:
    # round streams' and session streams' liveness on stand-in servers in tests/swarm/client/test_liveness.py, a
    # killed server under engine rounds in this file's last test)
    "tests/gateway/test_engine_round.py::test_a_frozen_server_fails_its_round_rows_over_by_liveness",
    # 500 honest steps each (about 2.5 min); the lying-server test checks honest sessions pass too
    # the previous release beside this one, more variants (make test: an old server + a new one under a new gateway,
    # tests/e2e/test_compat.py's first test; the records' and messages' compatibility in tests/swarm/wire)
    "tests/e2e/test_compat.py::test_training_across_an_old_and_a_new_server",
    "tests/e2e/test_compat.py::test_a_new_server_and_an_old_one_under_an_old_client",
    "tests/e2e/test_compat.py::test_failover_from_an_old_server_to_a_new_one",
    "tests/e2e/test_compat.py::test_a_rolling_upgrade_under_streaming_chats",
    # a server without beam reorders and left padding beside a full one (about 30 s: two servers; make test: routing
    # by capabilities on synthetic swarms and the client's per-message check, tests/swarm/client/
    # test_capability_routing.py)
    "tests/e2e/test_capability_swarm.py::",
    # 20 client models made and dropped (make test: 3, each way of ending one once)
    "tests/swarm/client/test_model_lifecycle.py::test_dropped_models_release_their_processes_and_files[20]",
    "tests/e2e/test_verify.py::test_honest_",
    # every signal x target x load combination; make test keeps one of each process kind (below)
    *(f"tests/e2e/test_shutdown.py::{case}" for case in (
        "test_dht_stops[SIGTERM-group]", "test_dht_stops[SIGINT-alone]", "test_dht_stops[SIGINT-group]",
        "test_server_stops[SIGTERM-alone]", "test_server_stops[SIGTERM-group]", "test_server_stops[SIGINT-group]",
        "test_server_stops[SIGINT-alone]", "test_server_stops[SIGTERM-alone-load]",
        "test_server_stops[SIGINT-group-load]", "test_gateway_stops[SIGTERM-alone]",
        "test_gateway_stops[SIGTERM-group]", "test_gateway_stops[SIGINT-group]", "test_gateway_stops[SIGINT-alone]",
        "test_gateway_stops[SIGTERM-alone-load]", "test_gateway_stops[SIGINT-group-load]",
        "test_up_stops[SIGTERM-alone]", "test_up_stops[SIGINT-group]", "test_client_exits_quietly[exit]",
        # a group SIGTERM announcing offline (make test: the same with a group SIGINT, Ctrl-C)
        "test_a_group_stop_announces_offline_before_the_dht_child_goes[SIGTERM]")),
    # eight conversations sharing a 1,024-token system prompt at once and a next turn, and a failover after an
    # adopted prefix (about 3 min; make test: tests/e2e/test_prefix_cache.py's first test, a conversation adopting
    # another's 256-token prompt end to end and one of another salt not, and the pages, budget eviction and rewind
    # rule in tests/server/test_prefix_cache.py)
    "tests/e2e/test_prefix_cache.py::test_concurrent_conversations_compute_the_shared_prompt_once",
    "tests/e2e/test_prefix_cache.py::test_failover_after_an_adopted_prefix_gives_the_same_tokens",
    # a new session routed to the replica whose record announces its prompt's pages (about 25 s: two tiny servers; make
    # test: the routing rules on synthetic swarms, tests/swarm/client/test_prefix_routing_unit.py, the summary a
    # server's handler and record make, tests/server/test_prefix_summary.py, and the record field,
    # tests/swarm/wire/test_prefix_pages.py)
    "tests/e2e/test_prefix_routing.py::",
    # the 2- and 3-hop topologies (make test: the 0:15 + 15:30 split, and every other e2e test on it)
    "tests/e2e/test_swarm_e2e.py::test_greedy_generation_matches_transformers[0:10+10:20+20:30]",
    "tests/e2e/test_swarm_e2e.py::test_greedy_generation_matches_transformers[0:20+10:30]",
    # placement scenarios of three servers (make test: placement policy on synthetic swarms, the serving loop)
    "tests/e2e/test_self_placement.py::test_three_servers_cover_the_model_and_recover_from_a_crash",
    "tests/e2e/test_self_placement.py::test_a_moving_server_lets_running_sessions_finish",
    # two free servers filling a hole left by a pinned one, stopped or SIGKILLed (about 2 min each; make test: the
    # hole watch's turns on synthetic swarms in tests/server/test_placement.py, its pings in
    # tests/server/test_hole_liveness.py)
    "tests/e2e/test_gap_fill.py::",
    # eight self-placed servers on a tiny Llama, two killed during a chat (about 65 s; make test: the placement policy
    # on synthetic swarms, the failover tests)
    "tests/e2e/test_swarm_scale.py::",
    # the nf4 -> int8 -> float failover chain (make test: quantized swarms, failover on float)
    "tests/e2e/test_quant_swarm.py::test_a_mixed_swarm_fails_over_from_nf4_to_int8_to_float",
    # a link cut in network namespaces (make test: processes on their own hosts; a frozen server on loopback)
    "tests/e2e/test_multihost.py::test_a_cut_link_mid_stream_fails_over_with_the_same_text",
    # schemathesis against a real gateway (make test: the same properties on the in-process app)
    "tests/gateway/test_api_property.py::test_property_against_a_real_gateway",
    # out-of-cache scenarios that wait for time-outs (make test: the budget's waits, pooled eviction)
    "tests/gateway/test_session_pool.py::test_out_of_cache_evicts_pooled_sessions_and_retries",
    "tests/server/test_cache_budget.py::test_session_gets_out_of_cache_after_the_timeout",
    # an Agents SDK agent streamed, json_schema on the real model (make test: the same agent run plainly, the SDK's
    # streamed responses; text.format json_schema in process, chat's json_schema through the swarm)
    "tests/gateway/test_responses.py::test_an_agents_sdk_agent_streams",
    "tests/gateway/test_responses.py::test_json_schema_output_parses_and_validates",
    # the prompt-tuning example's training runs (make test: gradients vs transformers, classification training)
    "tests/e2e/test_training_example.py::",
    # a frozen server on loopback (make test: the liveness rules, fast; failover of killed and erroring servers)
    "tests/swarm/client/test_liveness.py::test_a_frozen_server_mid_generation_is_failed_over_on_loopback",
    # three of the six newer families through a split swarm (make test: every family in process against
    # transformers, and Qwen3 (with the gateway), Qwen3-MoE and Gemma 2 through split swarms)
    *(f"tests/swarm/modeling/test_family_open_models.py::test_family_through_a_split_swarm[{case}]"
      for case in ("phi3", "gemma3_text", "gpt_oss")),
    # BLOOM's int8 servers (38 s: an int8 span runs each session alone; make test: int8 swarms on SmolLM2 in
    # test_quant_swarm, a quantized BLOOM-family server with nf4 on falcon-new)
    "tests/swarm/modeling/test_family_bloom_falcon.py::test_quantized_servers_generate[bloom-int8]",
    # llama and qwen2 tiny checkpoints through a split swarm (make test: SmolLM2 is a llama, qwen2 in process;
    # mistral and mixtral through swarms), and mistral's failover (make test: mixtral's)
    "tests/e2e/test_family_swarms.py::test_family_through_a_split_swarm[llama]",
    "tests/e2e/test_family_swarms.py::test_family_through_a_split_swarm[qwen2]",
    "tests/e2e/test_family_swarms.py::test_failover_replays_a_session[mistral]",
    # Falcon's multi-query layout through a swarm (make test: in process against transformers; new layout, ALiBi)
    *(f"tests/swarm/modeling/test_family_bloom_falcon.py::{name}[falcon-mq]" for name in (
        "test_greedy_tokens_and_logits_equal_transformers", "test_left_padded_batch_equals_transformers",
        "test_two_turn_session",
        "test_long_prompt_prefills_in_chunks", "test_concurrent_sessions_batched_equal_single",
        "test_gateway_completions_and_chat", "test_failover_replays_the_session")),
    # generation through the latency lab's delayed links (make test: the lab's links measure their latency, a
    # hivemind ping through it; greedy equality on loopback swarms)
    "tests/launch/test_latency_lab.py::test_greedy_generation_through_delayed_links_matches_transformers",
    # one server per span through a gateway with spot-checks (make test: tests/e2e/test_verify.py counts unverifiable
    # spans through the client; the gateway's counters in test_a_lying_server_is_caught_through_the_gateway)
    "tests/gateway/test_gateway_verify.py::test_one_server_per_span_is_counted_unverifiable",
    # sampled speculation through the swarm runs to its length (make test: the sampling rule's distribution in
    # process, greedy speculation through the swarm and the gateway)
    "tests/swarm/client/test_speculative.py::test_swarm_speculative_sampling_runs_and_stops",
    # a session opened without a push token (make test: an outsider's pushes refused in a live session)
    "tests/server/test_push_binding.py::test_pushes_into_a_session_opened_without_a_token_are_refused",
    # nf4 through a swarm (make test: int8 through a swarm; nf4 against the locally quantized model in process)
    "tests/e2e/test_quant_swarm.py::test_quantized_swarm_generates_what_the_locally_quantized_model_does[nf4]",
    # the client-level liar with random checks (make test: the liar through the gateway with retraction, and a check
    # asked for that waits, retracts and leaves the liar, in tests/gateway/test_gateway_verify.py)
    "tests/e2e/test_verify.py::test_a_lying_server_is_caught_and_the_text_is_unchanged",
    # training across a killed server (make test: training gradients through the swarm equal transformers'; the
    # inference failover tests)
    "tests/e2e/test_training_failover.py::test_training_survives_a_killed_server",
    # $ref schemas and json_object through a real gateway (make test: json_schema through the gateway, $ref and
    # json_object grammars in process)
    "tests/gateway/test_structured.py::test_json_schema_with_refs_and_json_object",
    # hypothesis over training streams (make test: training calls time out, count as streams and are capped, in
    # tests/server/test_limits.py; the inference RPCs' fuzzing in tests/server/test_fuzz_rpc.py)
    "tests/server/test_fuzz_training.py::test_fuzzed_training_streams",
    # issue 39's variants through a real gateway (make test: a cut `required` call and a strict call through it; cut
    # named calls and closed schemas in process, every cut point by the parser, every closed grammar sampled)
    "tests/gateway/test_tools.py::test_forced_call_cut_by_max_tokens_is_a_partial_call[named]",
    "tests/gateway/test_tools.py::test_strict_tool_arguments_have_every_property_and_no_other[closed]",
    # a volunteer behind a NAT in three network namespaces, a home server whose relay reservation comes late, its
    # relay restarted at the end (twice: the second time unheard of by the home server), about 3-5 min (make test:
    # the dial-back check against the bootstrap peer on loopback, the relay arguments and flags, routing's
    # preference for direct servers, in tests/swarm/wire/test_reachability.py; sole-server retries in
    # tests/swarm/client/test_sole_retry.py; a server whose own addresses and first record stores fail at first, on
    # loopback, in tests/server/test_own_addrs.py; the relay watch's renewal and its probe's refused and silent
    # dials through the bootstrap peer, in tests/server/test_network.py)
    "tests/e2e/test_nat.py::",
    # speculation asked per request on the scripted gateway (make test: through a real gateway in test_gateway.py)
    "tests/swarm/client/test_speculative.py::test_gateway_speculative_requests_match_plain_ones",
    # a session's replay onto a second split server (make test: the split server's prefill, rewinds and beams in
    # tests/test_tensor_parallel*.py; failover replay itself in tests/e2e/test_failover.py)
    "tests/e2e/test_tensor_parallel_swarm.py::test_failover_replays_a_session_onto_a_split_server",
    # mistral on one tiny server (make test: mistral through a split swarm in tests/e2e/test_family_swarms.py, with
    # failover through mixtral's; llama and qwen2 on one tiny server here)
    "tests/swarm/modeling/test_families.py::test_tiny_family_through_the_swarm[mistral]",
    # json_object run to its end (make test: the same json_object request cut at 10 tokens through the same gateway,
    # streamed and not; the json_object grammar in process in tests/gateway/test_structured.py)
    "tests/gateway/test_gateway.py::test_json_object_output_parses[60]",
    # beam search with 3 returned sequences and length penalty 0.6 (make test: num_beams=3, returned sequences with
    # scores, a negative length penalty with early_stopping, n-gram and repetition penalties, on the same swarm)
    "tests/e2e/test_beam.py::test_beam_search_on_a_padded_batch_equals_transformers[num_beams=4,",
    # a first-span server dying during beam search (make test: the last-span one on the same swarm; first-span
    # failover with speculative rewinds in tests/e2e/test_failover.py)
    "tests/e2e/test_beam.py::test_a_server_dying_during_beam_search_keeps_the_output[first-span]",
    # Mixtral's session failover (make test: Qwen3-MoE's through the same check_failover_replay at the end of its
    # split swarm's test in tests/swarm/modeling/test_family_open_models.py, SmolLM2's failover tests; Mixtral
    # through a split swarm and a gateway)
    "tests/e2e/test_family_swarms.py::test_failover_replays_a_session[mixtral]",
    # a Mixtral adapter on its experts through two servers (about 45 s; make test: the same adapter kinds against
    # peft in process on every mixture of experts, prefill and batched decode, in test_family_open_models.py, and
    # adapters through real servers in the rest of test_lora_swarm.py)
    "tests/e2e/test_lora_swarm.py::test_expert_adapter_through_a_split_swarm",
    # two of generate's five local runs against transformers' generate (make test: every applied setting builds
    # transformers' processors, in test_each_applied_setting_builds_transformers_processors; generate against
    # transformers with n-gram, bad-words and suppress processors, and sampling with epsilon/eta cut-offs, a
    # temperature and several return sequences)
    "tests/swarm/client/test_generation.py::test_generate_settings_match_transformers[do_sample,forced_eos_token_id,",
    "tests/swarm/client/test_generation.py::test_generate_settings_match_transformers[do_sample,typical_p,",
    # --- moved at stop 42 to bring `make test` toward its budget (each with what still covers it) ---
    # quantized quality against float32 is a measurement (bench/bench_quant.py prints it; make test: int8/nf4 blocks
    # equal transformers' bitsandbytes model in tests/server/test_quant.py)
    "tests/e2e/test_quant_swarm.py::test_quality_against_float32_is_reported",
    # an nf4 swarm's session across turns (make test: the int8 one on its swarm; nf4 on a Falcon server through a swarm;
    # nf4 blocks in process, chunked and batched)
    "tests/e2e/test_quant_swarm.py::test_a_quantized_session_goes_on_across_turns[nf4]",
    # the gateway stopping under load and a server stopping children first (make test: the server stopping under load,
    # the gateway stopping children first, `up` stopping under load)
    "tests/e2e/test_shutdown.py::test_gateway_stops[SIGTERM-group-load]",
    "tests/e2e/test_shutdown.py::test_server_stops[SIGTERM-group-children-first]",
    # client-side processors through the swarm (make test: n-gram and bad-words processors against transformers in
    # tests/swarm/client/test_generation.py, on logits the swarm equals transformers on), and decode steps without
    # pushes (make test: with pushes, and every other e2e test's steps)
    "tests/e2e/test_swarm_e2e.py::test_no_repeat_ngram_and_bad_words_match_transformers",
    "tests/e2e/test_swarm_e2e.py::test_decode_steps_are_pushed_between_servers[False]",
    # an evicted pooled session (make test: an expired one falls back the same way; eviction in
    # tests/gateway/test_session_pool_unit.py)
    "tests/gateway/test_session_pool.py::test_evicted_session_falls_back_cleanly",
    # Falcon's new decoder layout through swarms (make test: its blocks against transformers in process, its nf4 server
    # through a swarm; Falcon's ALiBi layout and BLOOM through every swarm case)
    *(f"tests/swarm/modeling/test_family_bloom_falcon.py::{name}[falcon-new]" for name in (
        "test_greedy_tokens_and_logits_equal_transformers", "test_left_padded_batch_equals_transformers",
        "test_two_turn_session", "test_long_prompt_prefills_in_chunks", "test_concurrent_sessions_batched_equal_single",
        "test_gateway_completions_and_chat", "test_failover_replays_the_session")),
    # sampling processors on a padded batch through the swarm (make test: greedy on a padded batch and a padded session
    # across turns through the swarm; the processors against transformers in process)
    "tests/e2e/test_padding.py::test_sampling_and_processors_on_a_padded_batch_equal_transformers",
    # json_schema with n=2 (make test: json_schema greedy through the gateway, n=2 choices in test_gateway.py)
    "tests/gateway/test_structured.py::test_json_schema_output_validates[n2]",
    # a stalled backward call timing out (make test: a stalled forward call, the same limit and counting)
    "tests/server/test_limits.py::test_training_calls_time_out_and_count_as_streams[True]",
    # GPT-OSS through two nf4 servers (about 20 s; make test: its int8 / nf4 blocks equal transformers' locally
    # quantized model in process, chunked prefill and batched decode, in test_gpt_oss_quant.py; nf4 swarms of other
    # families in test_quant_swarm.py and test_family_bloom_falcon.py)
    "tests/swarm/modeling/test_gpt_oss_quant.py::test_an_nf4_split_swarm_generates_what_the_locally_quantized_model_does",
    # MXFP4 (GPT-OSS; also nf4 of it) and FP8 (DeepSeek-V3) checkpoints as published through two servers (make test:
    # the same loading path in process, blocks bit-equal to transformers' dequantized model, logits and greedy decode
    # steps, nf4 of them, the memory plan, the shards read and the malformed checkpoints: the rest of
    # test_checkpoint_quant.py)
    "tests/swarm/modeling/test_checkpoint_quant.py::test_split_swarm_",
    # a gateway started with `--model all` over two models' servers (about 15 s; make test: the same discovery read
    # from the same servers' records in process, and a gateway started with `--model` twice over them, in
    # test_gateway_models.py)
    "tests/gateway/test_gateway_models.py::test_model_all_serves_every_model_the_swarm_announces",
)


def pytest_sessionfinish(session, exitstatus):
    """Remove this session's directory (`SESSION_DIR`) after a run that passed; after a failure it stays, with the
    logs of the processes that took part."""
    if exitstatus == 0:
        shutil.rmtree(SESSION_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if item.nodeid.startswith(EXTENDED):
            item.add_marker(pytest.mark.extended)
    # files named by node id (`file.py::test`) collect only what was named: they are not judged
    picked = {arg.split("::")[0] for arg in config.args if "::" in arg}
    stale = [prefix for prefix in stale_extended(EXTENDED, [item.nodeid for item in items], config.rootpath)
             if not any(prefix.startswith(path) or path.endswith(prefix.split("::")[0]) for path in picked)]
    if stale:
        raise pytest.UsageError("tests/conftest.py EXTENDED names no test (renamed or removed?): " + ", ".join(stale))


def stale_extended(prefixes, nodeids, root) -> list:
    """The EXTENDED prefixes that name no test: a file that does not exist, or a collected file none of whose
    collected tests starts with the prefix (files not collected in this run are not judged)."""
    collected_files = {nodeid.split("::")[0] for nodeid in nodeids}
    stale = []
    for prefix in prefixes:
        path = prefix.split("::")[0]
        if not (root / path).is_file():
            stale.append(prefix)
        elif path in collected_files and not any(nodeid.startswith(prefix) for nodeid in nodeids):
            stale.append(prefix)
    return stale


@pytest.fixture(scope="session")
def model_path():
    from swarm.modeling.prepare import prepare_model

    return str(prepare_model(MODEL))


@pytest.fixture(scope="session")
def bootstrap():
    # (on loopback the relay limits check is skipped by default: the session's relay checks them, which
    # tests/server/test_relay_limits.py reads)
    proc = start_bootstrap(threads=1, extra=["--relay_limits_check", "on"])
    yield proc
    proc.terminate()


class SwarmFactory:
    """Starts sets of servers for a topology under its own DHT prefix, each once while it is kept.

    The session's main swarm (`MAIN`: ("0:15", "15:30"), no extra flags: the shared gateway's, and most modules')
    lives for the whole session. Any other swarm (other spans, extra flags) is stopped when the test module that
    started it ends (`end_module`, by the autouse `_module_swarms`): it serves that module's tests, and with a
    worker per core (`make test`) a session's every swarm alive at once would not fit in memory twice. A later
    module that asks for it again gets a fresh one, under a prefix of its own (`prefix`)."""

    MAIN = (("0:15", "15:30"), ())

    def __init__(self, model_path: str, bootstrap):
        self.model_path, self.bootstrap = model_path, bootstrap
        self.swarms: dict = {}
        self.starts: dict = {}  # (spans, extra) -> how many times it was started

    def prefix(self, spans: tuple, extra: tuple = ()) -> str:
        """The DHT prefix of that swarm (known before it starts: a process of the test's own can start beside it)."""
        key = (tuple(spans), tuple(extra))
        tag = "-x" + str(abs(hash(extra)) % 10**6) if extra else ""
        restarts = self.starts.get(key, 0) - (1 if key in self.swarms else 0)
        again = f"-g{restarts}" if restarts > 0 else ""
        return "t" + "-".join(s.replace(":", "_") for s in spans) + tag + again

    def get(self, spans: tuple, extra: tuple = ()) -> dict:
        key = (tuple(spans), tuple(extra))
        if key not in self.swarms:
            prefix = self.prefix(*key)
            servers = start_servers(self.model_path, [self.bootstrap.maddr], list(spans), prefix, list(extra),
                                    threads=1)
            self.starts[key] = self.starts.get(key, 0) + 1
            self.swarms[key] = {"prefix": prefix, "servers": servers, "initial_peers": [self.bootstrap.maddr]}
        return self.swarms[key]

    def end_module(self) -> None:
        """Stop every swarm but the main one (a module's own: see the class)."""
        ended = [key for key in self.swarms if key != self.MAIN]
        terminate_all([server for key in ended for server in self.swarms.pop(key)["servers"]])

    def close(self) -> None:
        terminate_all([server for swarm in self.swarms.values() for server in swarm["servers"]])
        self.swarms.clear()


_FACTORIES: list = []  # the session's SwarmFactory once `swarms` made it (for `_module_swarms`)


@pytest.fixture(scope="session")
def swarms(model_path, bootstrap):
    factory = SwarmFactory(model_path, bootstrap)
    _FACTORIES.append(factory)
    yield factory
    _FACTORIES.remove(factory)
    factory.close()


@pytest.fixture(scope="module", autouse=True)
def _module_swarms():
    """At the end of each test module (after its own module fixtures, set up after this one), its swarms other than
    the session's main one stop (`SwarmFactory.end_module`)."""
    yield
    for factory in _FACTORIES:
        factory.end_module()


@pytest.fixture(scope="session")
def reference_model(model_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
