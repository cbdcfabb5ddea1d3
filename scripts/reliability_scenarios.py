"""The reliability report's scenarios: for each row of docs/reliability.md, what was done, what must
hold, and which tests measure it (`tests`: substrings of their ids; `run`: tests outside
tests/reliability that the report's run adds).

scripts/reliability_report.py runs the tests and fills in the figures they record through the
`figure` fixture (tests/figures.py) under each scenario's number. This module only describes the
scenarios: it must not run or judge anything.
"""

from __future__ import annotations

SCENARIOS: dict[int, dict[str, str | tuple[str, ...]]] = {
    1: {
        "title": "Overload burst",
        "done": "A burst of 200 requests at once against a worker of 4 credits and a route queue of 4, "
        "each admitted request running 3 s (test-mode step delay).",
        "holds": "Exactly 200 - (4 + 4) refused with RESOURCE_EXHAUSTED and a RetryInfo retry hint; "
        "every accepted request completes with all its tokens.",
        "tests": ("test_s01_",),
    },
    2: {
        "title": "kill -9 of the primary mid-stream",
        "done": "SIGKILL of the primary worker 5 tokens into a 60-token stream; then a restart of it "
        "on its old port.",
        "holds": "The stream continues on the fallback with no token lost or repeated; new requests "
        "are served by the fallback; the restarted primary serves again.",
        "tests": ("test_failover.test_kill9",),
    },
    3: {
        "title": "SIGSTOP of the primary",
        "done": "SIGSTOP of the primary worker, then SIGCONT.",
        "holds": "Noticed within 3 s (traffic on the fallback; 15 s asserted); the primary serves "
        "again after SIGCONT.",
        "tests": ("test_failover.test_sigstop",),
    },
    4: {
        "title": "Graceful shutdown under load",
        "done": "SIGTERM to the tokenizer, the worker and the gateway in turn (a fresh stack each) "
        "while 32 streams run; grace and drain 10 s.",
        "holds": "Health NOT_SERVING first; running streams finish (gateway, worker) or end UNAVAILABLE "
        "(tokenizer); new calls get UNAVAILABLE; exit code 0 before the grace ends; the launcher "
        "restarts nothing.",
        "tests": ("test_s04_",),
    },
    5: {
        "title": "Deadlines and cancellation",
        "done": "Requests with 1, 2 and 3 s deadlines against 40 s generations (0.2 s engine steps, "
        "test-mode delay); streams cancelled after 3 tokens, alone and next to another request.",
        "holds": "DEADLINE_EXCEEDED at the deadline; the worker frees the KV blocks within one engine "
        "step of the cancel (<= 1 step alone, <= 2 with another request, as GetWorkerStats shows it; "
        "in time, under 5x those steps).",
        "tests": ("test_s05_",),
    },
    6: {
        "title": "Bad input, fuzzed",
        "done": "Generated GenerateRequests (invalid UTF-8, huge and negative numbers, empty and "
        "oversized fields, thousands of stop strings, unknown models) and raw undecodable bytes.",
        "holds": "Every answer OK or a documented status, never UNKNOWN or INTERNAL; the stack stays "
        "healthy and serves a good request after each run.",
        "tests": ("test_s06_", "fuzz"),
    },
    7: {
        "title": "Soak",
        "done": "5,000 requests from 16 clients on the tiny model: mixed lengths, 10% cancelled "
        "mid-stream, 10% with 20-300 ms deadlines.",
        "holds": "Running and waiting counts, KV blocks and the gateway queue return exactly to their "
        "initial values; each service's RSS grows at most 20% after the warm-up.",
        "tests": ("test_s07_",),
    },
    8: {
        "title": "Tokenizer dies and comes back",
        "done": "SIGKILL of the tokenizer service, requests while it is down (30 s deadlines), then a "
        "new tokenizer process on the same port.",
        "holds": "While down each request fails with UNAVAILABLE within 1 s; requests succeed again "
        "within 2 s of its return (10 s asserted).",
        "tests": ("test_s08_",),
    },
    9: {
        "title": "Slow or stuck client",
        "done": "A client with a 1 KiB HTTP/2 window reads the first message of a 3,000-token stream "
        "(60 s at the least: 0.02 s test-mode delay per step) and then nothing; stream_idle_timeout_s "
        "is 1 s.",
        "holds": "The gateway does not buffer without bound nor hold KV blocks forever: the idle "
        "timeout cancels the request (CANCELLED, naming stream_idle_timeout_s) and the worker frees its "
        "KV blocks within 25 s of the last read (5x the expected 5 s), long before its natural end.",
        "tests": ("test_s09_", "stuck", "slow_client"),
    },
    10: {
        "title": "Batching invariance under load",
        "done": "32 concurrent greedy requests of mixed prompt lengths through the stack (chunked "
        "prefills mixed with decodes).",
        "holds": "Each output equals the prompt's solo output (transformers, one at a time) under the "
        "parity rule of tests/parity.py.",
        "tests": ("test_s10_",),
    },
    11: {
        "title": "Chaos soak",
        "done": "Open-loop load through the client SDK (unary and streams, mixed lengths, client cancels, "
        "short deadlines, greedy with ignore_eos and some sampled) while a seeded injector hits the "
        "primary worker, the fallback worker and the tokenizer in turn with kill -9, SIGSTOP then "
        "SIGCONT and SIGTERM, and the gateway with kill -9; `strata up`'s supervisor restarts them. "
        "Full (`make chaos`): configs/local.yaml's stack (SmolLM2-135M-Instruct, its int8 fallback on "
        "int8-weight-only), 8 minutes, 18 faults; CI: tiny models, 60 s, 10 faults.",
        "holds": "Every completed greedy answer's tokens equal the primary's reference before "
        "failover_at_token and the fallback's greedy continuation after it, every token compared "
        "(parity rule at near ties, the continuation then taken from the flipped token), none "
        "unverified; every repeated, dropped, replaced or context-shifted token injected at a real "
        "failover is caught; failures end UNAVAILABLE, RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED (or the "
        "client cancelled), at most 1 s past their deadline; SDK retries rescue some; after each fault "
        "fully serving within 10 s plus the slowest restart measured, one restart per kill or SIGTERM; "
        "worker and gateway state back exactly to idle; RSS growth at most 5% (CI: 10%) after a warm "
        "baseline.",
        "tests": ("test_s11_",),
    },
    12: {
        "title": "Scale-out: one of two replicas killed",
        "done": "Two worker processes of one model behind one DNS name (as a Kubernetes headless "
        "Service resolves to its pods); 6 clients stream 24-token greedy requests; SIGKILL of one "
        "replica while they stream.",
        "holds": "No request fails, before its first token or mid-stream; a stream cut by the kill "
        "continues on the survivor token for token (its tokens equal the greedy reference); the "
        "survivor takes the traffic.",
        "tests": ("test_scale_out",),
    },
    13: {
        "title": "No API key or a wrong one",
        "done": "Generate over TLS to a gateway with API keys (one in its settings, one in a keys "
        "file): with no key, an empty key, a wrong key and a configured key plus one character; then "
        "with each configured key.",
        "holds": "Every request without a configured key is answered UNAUTHENTICATED, naming the "
        "`authorization: Bearer` header; each configured key is served.",
        "tests": ("test_security.test_a_missing_or_wrong_key", "test_security.test_a_client_with_a_key"),
        "run": (
            "tests/integration/test_security.py::test_a_missing_or_wrong_key_is_unauthenticated",
            "tests/integration/test_security.py::test_a_client_with_a_key_is_served_over_tls_end_to_end",
        ),
    },
    14: {
        "title": "No client certificate or a rogue one",
        "done": "Calls to the worker's and the tokenizer service's mutual-TLS ports with no client "
        "certificate, with a self-signed rogue one, and with the gateway's, signed by the CA.",
        "holds": "Without a certificate from the CA the TLS handshake is refused (UNAVAILABLE); the "
        "CA-signed certificate is served.",
        "tests": ("test_security.test_only_a_certificate",),
        "run": (
            "tests/integration/test_security.py::"
            "test_only_a_certificate_from_the_ca_reaches_the_internal_services",
        ),
    },
    15: {
        "title": "Plaintext on the TLS ports",
        "done": "A plaintext health check to the main (TLS) port of the gateway, the worker and the "
        "tokenizer service; a health check over TLS with no key to the gateway; plaintext liveness "
        "checks to the worker's and the tokenizer's health-only ports.",
        "holds": "Plaintext reaches no TLS port (UNAVAILABLE); health over TLS needs no key; only the "
        "health-only ports answer plaintext.",
        "tests": ("test_security.test_health_needs_no_key",),
        "run": (
            "tests/integration/test_security.py::"
            "test_health_needs_no_key_and_plaintext_reaches_nothing_but_the_health_ports",
        ),
    },
    16: {
        "title": "A service killed under strata up",
        "done": "Through the real `strata up`: kill -9 of the worker, the tokenizer and the gateway of a "
        "tiny stack; on the default model and its int8 fallback, kill -9 of the primary worker, then "
        "of the tokenizer, sending one short request after another until each is served again.",
        "holds": "Each killed service is started again on the address the others know and serves; the "
        "gateway uses a restarted worker without a restart of its own; on the default model the "
        "fallback serves within 1 s of the primary's kill and the primary again within 60 s, and "
        "requests succeed within 10 s of the tokenizer's kill (bounds asserted: 5x).",
        "tests": ("test_supervision",),
        "run": ("tests/integration/test_supervision.py",),
    },
    17: {
        "title": "gRPC clients that flood or misbehave",
        "done": "Raw HTTP/2 (h2) and grpcio clients against a worker server (every service builds its "
        "server the same way): two Connect streams hold a server capped at two calls while 100 more "
        "calls arrive; three streams on a connection capped at two; 20 pings back to back; a DATA frame "
        "1 KiB over the max frame size the server announced.",
        "holds": "Calls past max_concurrent_rpcs are refused with RESOURCE_EXHAUSTED naming the limit, "
        "a RetryInfo and pushback (p99 round trip under 250 ms) while health checks answer SERVING; "
        "the third stream waits while another connection is served and starts when one ends; the "
        "pinging client gets GOAWAY (too_many_pings); the oversized frame ends its connection "
        "unanswered; a good call is served after each.",
        "tests": ("test_s17_",),
    },
    18: {
        "title": "HTTP clients that trickle, hold or never read",
        "done": "Raw sockets against the HTTP API (head and body timeouts 0.5 s, 4 connections, "
        "stream idle timeout 1 s): a head sent a byte every 50 ms; a silent connection; a body cut "
        "after 10 of 200 bytes; 4 idle connections then the openai SDK; a 2,000-token stream (60 s "
        "at the least) read through a 4 KiB buffer, first event only.",
        "holds": "408 with an OpenAI error body naming the setting for the slow head, the silent "
        "connection and the cut body (within 5x the timeout); 503 too_many_connections with "
        "Retry-After as the SDK parses it, and the SDK served once the connections close; the unread "
        "stream cancelled (stuck-stream count +1) and its KV blocks freed long before its end; the "
        "SDK served after each.",
        "tests": ("test_s18_",),
    },
}
