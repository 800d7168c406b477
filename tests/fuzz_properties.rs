//! The short, seeded fuzz campaign of every parser of outside bytes (targets in `tests/fuzz`):
//! a few hundred cases each, the same cases on every run. The long campaign is
//! `cargo bench --bench fuzz -- --minutes 10`.

mod fuzz;

#[global_allocator]
static ALLOCATOR: fuzz::CountingAlloc = fuzz::CountingAlloc;

/// The CI seed: change it only on purpose (a failure it found is then a regression test).
const SEED: u64 = 0x6f72_6361_6675_7a7a;

fn campaign(name: &str) {
    let target = fuzz::TARGETS
        .iter()
        .find(|target| target.name == name)
        .unwrap_or_else(|| panic!("no target {name}"));
    let mut runner = fuzz::runner(SEED, target.ci_cases);
    if let Err(failure) = (target.run)(&mut runner) {
        panic!("{name}: {failure}");
    }
}

#[test]
fn splice_frames_vs_tungstenite() {
    campaign("splice_frames_vs_tungstenite");
}

#[test]
fn splice_frames_random_bytes() {
    campaign("splice_frames_random_bytes");
}

#[test]
fn control_messages_json() {
    campaign("control_messages_json");
}

#[test]
fn switch_file() {
    campaign("switch_file");
}

#[test]
fn env_config() {
    campaign("env_config");
}

#[test]
fn jwt_header_and_claims() {
    campaign("jwt_header_and_claims");
}

#[test]
fn http_request_head() {
    campaign("http_request_head");
}

#[test]
fn upgrade_validation() {
    campaign("upgrade_validation");
}

#[test]
fn budget_fleet() {
    campaign("budget_fleet");
}

/// The model-based property test of the splice worker (issue 18): random interleavings of
/// data, fragments, pings, pongs, slow readers, closes and hang-ups on several pairs, through
/// the real worker and real sockets, against RFC 6455 relaying.
#[test]
fn splice_worker_model() {
    campaign("splice_worker_model");
}

/// The reproduction, fixed: text and a ping in one write from a slowly reading phone
/// while its desktop streams to it; every frame must arrive.
#[test]
fn splice_worker_model_ping_after_data() {
    let scenario = fuzz::splice_model::ping_after_data_under_backpressure();
    for round in 0..2 {
        if let Err(failure) = fuzz::splice_model::run_scenario(&scenario) {
            panic!("round {round}: {failure}");
        }
    }
}

#[test]
fn every_target_has_a_test() {
    let source = include_str!("fuzz_properties.rs");
    for target in fuzz::TARGETS {
        assert!(
            source.contains(&format!("fn {}()", target.name)),
            "{} has no #[test] here",
            target.name
        );
    }
}
