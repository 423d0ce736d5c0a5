//! The cost of reading a streamed answer for its cost, per piece relayed:
//! an OpenAI stream of 200 content chunks and its usage chunk, a chunk a
//! piece, read as the engines read it (`BodySettle::push`) and edited as
//! they relay a stream whose usage usher asked for (`BodySettle::edit`),
//! beside copying the piece (what relaying it costs at the least); and a
//! demand meter's count of one arrival, whole and fractional, beside the
//! count of thousandths it replaced.
//!
//! `cargo bench -p usher-enforce --no-default-features --bench settle`

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http::StatusCode;
use usher_core::clock::Clock;
use usher_core::config::routes::RoutesConfig;
use usher_enforce::metrics::Metrics;
use usher_enforce::resource::{self, RouteResource};
use usher_enforce::settle;
use usher_limit::{DemandMeter, LeaseTable, Plan};

const CONTENT: &str = "data: {\"id\":\"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT\",\"object\":\"chat.completion.chunk\",\
    \"created\":1741569952,\"model\":\"gpt-4.1-2025-04-14\",\"system_fingerprint\":\"fp_7fcd609668\",\
    \"choices\":[{\"index\":0,\"delta\":{\"content\":\" word\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n";
const USAGE: &str = "data: {\"id\":\"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT\",\"object\":\"chat.completion.chunk\",\
    \"choices\":[],\"usage\":{\"prompt_tokens\":19,\"completion_tokens\":200,\"total_tokens\":219}}\n\ndata: [DONE]\n\n";

/// The route resource of a routes file that settles `tokens` from OpenAI's usage.
fn resources() -> Arc<[RouteResource]> {
    let yaml = "resources:\n  tokens: { kind: rate, capacity: 1000000/s, burst: 1000000 }\n\
                routes:\n  - { name: chat, resources: [{ resource: tokens, cost: 100, settle: { usage: openai } }] }\n";
    let cfg = RoutesConfig::parse("routes.yaml", yaml).unwrap();
    let table = LeaseTable::new(Clock::system());
    table.configure(resource::specs(&cfg));
    let metrics = Metrics::new(prometheus::Registry::new());
    let rule = cfg.routes[0].cost_rules.get("tokens");
    Arc::from([RouteResource::new(&cfg, "chat", "tokens", 100.0, rule, &table, &metrics).unwrap()])
}

fn stream(c: &mut Criterion) {
    let resources = resources();
    let plan = Plan::default();
    let header = |name: &str| (name == "content-type").then_some(&b"text/event-stream"[..]);
    let pieces: Vec<&[u8]> = std::iter::repeat_n(CONTENT.as_bytes(), 200).chain([USAGE.as_bytes()]).collect();
    let mut g = c.benchmark_group("a stream of 201 chunks, per chunk");
    g.throughput(Throughput::Elements(pieces.len() as u64));
    g.bench_function("copied only (the least relaying costs)", |b| {
        let mut out = Vec::with_capacity(512);
        b.iter(|| {
            for p in &pieces {
                out.clear();
                out.extend_from_slice(black_box(p));
            }
        })
    });
    g.bench_function("read for its cost (usage: openai)", |b| {
        b.iter(|| {
            let mut s = settle::on_answer(&resources, &plan, StatusCode::OK, &header, false).unwrap();
            for p in &pieces {
                s.push(black_box(p));
            }
            s.finish();
        })
    });
    g.bench_function("read and edited (usage injected)", |b| {
        let mut out = Vec::with_capacity(512);
        b.iter(|| {
            let mut s = settle::on_answer(&resources, &plan, StatusCode::OK, &header, true).unwrap();
            for p in &pieces {
                out.clear();
                s.edit(black_box(p), &mut out);
            }
            s.finish();
        })
    });
    g.finish();
}

fn demand(c: &mut Criterion) {
    let meter = DemandMeter::default();
    c.bench_function("demand: one arrival, cost 1", |b| b.iter(|| meter.arrive(black_box(1.0))));
    c.bench_function("demand: one arrival, cost 0.05 (compare-and-swap)", |b| b.iter(|| meter.arrive(black_box(0.05))));
    // The count it replaced: thousandths of a cost, and the requests.
    let (thousandths, requests) = (AtomicU64::new(0), AtomicU64::new(0));
    c.bench_function("demand: one arrival, cost 1, in thousandths (as before)", |b| {
        b.iter(|| {
            thousandths.fetch_add((black_box(1.0f64) * 1000.0).round() as u64, Ordering::Relaxed);
            requests.fetch_add(1, Ordering::Relaxed);
        })
    });
}

criterion_group!(benches, stream, demand);
criterion_main!(benches);
