//! The connection budget tool (SPEC §10) against the shipped seed fleet and against bad input.
//!
//! The seed rows are the seed's own table (`dead-man-trip-slots.md`): 300/455/35, 332/487/3,
//! 308/463/27, 332/487/3, and the two-cell roll batch at 316. Both example files must print them,
//! and every bad input must name the field to fix.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use orca_relay::budget::{self, BudgetError, Format};
use serde_json::{json, Value};

const SEED_FILES: &[&str] = &["packaging/fleet-seed.json", "packaging/fleet-seed.toml"];

/// (scenario, slots, cells line, operating, usable, spare) as `orca-relay budget` prints them.
const SEED_ROWS: &[(&str, &str, &str, u64, u64, i64)] = &[
    ("main today", "-", "6x10 + 16x8 + 7x16 = 300", 455, 490, 35),
    (
        "plus C36/C37 at 16",
        "-",
        "6x10 + 16x8 + 9x16 = 332",
        487,
        490,
        3,
    ),
    (
        "same fleet, deadManTripSlots=2",
        "2",
        "76 + 128 + 8x12 + 2x4 = 308",
        463,
        490,
        27,
    ),
    (
        "plus two more Asia cells at 12",
        "2",
        "76 + 128 + 10x12 + 2x4 = 332",
        487,
        490,
        3,
    ),
    (
        "two-cell Asia roll batch in an outage",
        "2",
        "108 + 128 + 6x12 + 2x4 = 316",
        471,
        490,
        19,
    ),
];

fn manifest_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// Splits a printed table row into (scenario, slots, cells line, operating, usable, spare).
/// Columns are separated by two or more spaces.
fn columns(line: &str) -> Vec<String> {
    line.split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(str::to_string)
        .collect()
}

#[test]
fn both_seed_files_print_the_seed_table_exactly() {
    for file in SEED_FILES {
        let output = budget::run_file(&manifest_path(file)).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            output.contains("max_connections 500 - explicit reserve 10 = usable 490"),
            "{file}:\n{output}"
        );
        assert!(output.contains(" = 155\n"), "{file}: fixed total\n{output}");
        let lines: Vec<&str> = output.lines().collect();
        let header = lines
            .iter()
            .position(|l| l.starts_with("scenario"))
            .unwrap_or_else(|| panic!("{file}: no table header\n{output}"));
        assert_eq!(
            columns(lines[header]),
            [
                "scenario",
                "slots",
                "cells line",
                "operating",
                "usable",
                "spare"
            ]
        );
        let rows: Vec<Vec<String>> = lines[header + 1..]
            .iter()
            .take_while(|l| !l.is_empty())
            .map(|l| columns(l))
            .collect();
        let expected: Vec<Vec<String>> = SEED_ROWS
            .iter()
            .map(|(name, slots, line, operating, usable, spare)| {
                vec![
                    name.to_string(),
                    slots.to_string(),
                    line.to_string(),
                    operating.to_string(),
                    usable.to_string(),
                    spare.to_string(),
                ]
            })
            .collect();
        assert_eq!(rows, expected, "{file}:\n{output}");
    }
}

#[test]
fn seed_plan_figures_are_exact() {
    for file in SEED_FILES {
        let path = manifest_path(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let format = if file.ends_with(".json") {
            Format::Json
        } else {
            Format::Toml
        };
        let fleet = budget::parse_fleet(&text, format, file).unwrap();
        let plan = budget::plan(&fleet).unwrap();
        assert_eq!(plan.usable, 490);
        assert_eq!(plan.fixed_total, 155);
        let figures: Vec<(u64, u64, i64)> = plan
            .rows
            .iter()
            .map(|r| (r.cells, r.operating, r.spare))
            .collect();
        assert_eq!(
            figures,
            [
                (300, 455, 35),
                (332, 487, 3),
                (308, 463, 27),
                (332, 487, 3),
                (316, 471, 19)
            ],
            "{file}"
        );
    }
}

#[test]
fn the_two_example_files_describe_the_same_fleet() {
    let json = std::fs::read_to_string(manifest_path(SEED_FILES[0])).unwrap();
    let toml = std::fs::read_to_string(manifest_path(SEED_FILES[1])).unwrap();
    let json = budget::parse_fleet(&json, Format::Json, "json").unwrap();
    let toml = budget::parse_fleet(&toml, Format::Toml, "toml").unwrap();
    assert_eq!(json, toml);
}

#[test]
fn a_file_without_a_known_extension_is_tried_as_json_then_toml() {
    for file in SEED_FILES {
        let text = std::fs::read_to_string(manifest_path(file)).unwrap();
        let path = temp_file("fleet", &text);
        let output = budget::run_file(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(output.contains("76 + 128 + 8x12 + 2x4 = 308"), "{output}");
        let _ = std::fs::remove_file(path);
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input: every error names the field and the problem.

/// A small valid fleet that each bad case breaks in one place.
fn base() -> Value {
    json!({
        "max_connections": 500,
        "reserve": 10,
        "fixed_consumers": {"directors": 15, "auth": 20},
        "cell_groups": [
            {"name": "legacy", "count": 6, "pool": 10, "mode": "db"},
            {"name": "us", "count": 16, "pool": 8, "mode": "reserve", "measured_peak": 8},
            {"name": "asia", "count": 7, "pool": 16, "mode": "reserve", "measured_peak": 12}
        ],
        "scenarios": [
            {"name": "slots", "dead_man_trip_slots": 2},
            {"name": "roll", "extends": "slots", "flip_to_db": [{"group": "asia", "count": 2}]}
        ]
    })
}

fn check_error(fleet: &Value, field: &str, problem: &str) {
    let text = fleet.to_string();
    let result = budget::parse_fleet(&text, Format::Json, "case.json").and_then(|f| {
        budget::plan(&f)?;
        Ok(())
    });
    let err = match result {
        Ok(()) => panic!("expected an error at {field}, got a plan for {text}"),
        Err(err) => err,
    };
    let message = err.to_string();
    assert_eq!(err.field_path(), Some(field), "{message}");
    assert!(
        message.starts_with(&format!("{field}: ")),
        "{message} should start with the field"
    );
    assert!(
        message.contains(problem),
        "{message} should say {problem:?}"
    );
    assert!(!message.contains('\n'), "{message}");
}

#[test]
fn the_base_case_is_valid() {
    let fleet = budget::parse_fleet(&base().to_string(), Format::Json, "base").unwrap();
    let plan = budget::plan(&fleet).unwrap();
    assert_eq!(plan.rows.len(), 3);
}

#[test]
fn bad_inputs_name_the_field() {
    type Edit = fn(&mut Value);
    let cases: &[(&str, &str, Edit)] = &[
        ("max_connections", "missing", |v| {
            v.as_object_mut().unwrap().remove("max_connections");
        }),
        (
            "max_connections",
            "expected a positive integer, got 0",
            |v| v["max_connections"] = json!(0),
        ),
        ("reserve", "missing", |v| {
            v.as_object_mut().unwrap().remove("reserve");
        }),
        ("reserve", "expected a non-negative integer, got -10", |v| {
            v["reserve"] = json!(-10)
        }),
        ("reserve", "leaves nothing of max_connections 500", |v| {
            v["reserve"] = json!(500)
        }),
        (
            "fixed_consumers.auth",
            "expected a non-negative integer, got -20",
            |v| v["fixed_consumers"]["auth"] = json!(-20),
        ),
        (
            "cell_groups[2].pool",
            "expected a positive integer, got 0",
            |v| v["cell_groups"][2]["pool"] = json!(0),
        ),
        (
            "cell_groups[2].pool",
            "expected a positive integer, got the string \"16\"",
            |v| v["cell_groups"][2]["pool"] = json!("16"),
        ),
        (
            "cell_groups[2].pool",
            "expected a positive integer, got 2.5",
            |v| v["cell_groups"][2]["pool"] = json!(2.5),
        ),
        ("cell_groups[2].pool", "above 100", |v| {
            v["cell_groups"][2]["pool"] = json!(101)
        }),
        (
            "cell_groups[0].count",
            "expected a non-negative integer, got -1",
            |v| v["cell_groups"][0]["count"] = json!(-1),
        ),
        (
            "cell_groups[1].mode",
            "unknown mode the string \"database\"",
            |v| v["cell_groups"][1]["mode"] = json!("database"),
        ),
        ("cell_groups[1].mode", "missing", |v| {
            v["cell_groups"][1].as_object_mut().unwrap().remove("mode");
        }),
        (
            "cell_groups[2].measured_peak",
            "17 is above the group's pool of 16",
            |v| v["cell_groups"][2]["measured_peak"] = json!(17),
        ),
        (
            "cell_groups[2].measured_peak",
            "expected a non-negative integer, got -1",
            |v| v["cell_groups"][2]["measured_peak"] = json!(-1),
        ),
        (
            "cell_groups[2].name",
            "already the name of cell_groups[0]",
            |v| v["cell_groups"][2]["name"] = json!("legacy"),
        ),
        ("cell_groups[0].name", "missing", |v| {
            v["cell_groups"][0].as_object_mut().unwrap().remove("name");
        }),
        ("cell_groups[0].pol", "unknown field", |v| {
            v["cell_groups"][0]["pol"] = json!(10)
        }),
        ("cell_group", "unknown field", |v| {
            v["cell_group"] = json!([])
        }),
        (
            "dead_man_trip_slots",
            "expected an integer from 0 to 64, got 65",
            |v| v["dead_man_trip_slots"] = json!(65),
        ),
        (
            "deadManTripSlots",
            "expected an integer from 0 to 64, got -1",
            |v| v["deadManTripSlots"] = json!(-1),
        ),
        (
            "scenarios[0].dead_man_trip_slots",
            "expected an integer from 0 to 64, got 100",
            |v| v["scenarios"][0]["dead_man_trip_slots"] = json!(100),
        ),
        // Slots make every reserve group's peak required; the error points at the group.
        (
            "cell_groups[2].measured_peak",
            "missing for reserve group \"asia\"",
            |v| {
                v["cell_groups"][2]
                    .as_object_mut()
                    .unwrap()
                    .remove("measured_peak");
            },
        ),
        (
            "scenarios[1].extends",
            "neither the fleet nor an earlier scenario",
            |v| v["scenarios"][1]["extends"] = json!("later"),
        ),
        ("scenarios[1].name", "names an earlier row", |v| {
            v["scenarios"][1]["name"] = json!("slots")
        }),
        (
            "scenarios[1].flip_to_db[0].group",
            "no cell group named \"europe\"",
            |v| v["scenarios"][1]["flip_to_db"][0]["group"] = json!("europe"),
        ),
        (
            "scenarios[1].flip_to_db[0].group",
            "already in db mode",
            |v| v["scenarios"][1]["flip_to_db"][0]["group"] = json!("legacy"),
        ),
        (
            "scenarios[1].flip_to_db[0].count",
            "8 is more than the 7 cells of \"asia\"",
            |v| v["scenarios"][1]["flip_to_db"][0]["count"] = json!(8),
        ),
        (
            "scenarios[0].add_groups[0].pool",
            "expected a positive integer, got -16",
            |v| {
                v["scenarios"][0]["add_groups"] =
                    json!([{"name": "more", "count": 2, "pool": -16, "mode": "reserve"}])
            },
        ),
        (
            "scenarios[0].add_groups[0].measured_peak",
            "missing for reserve group \"more\"",
            |v| {
                v["scenarios"][0]["add_groups"] =
                    json!([{"name": "more", "count": 2, "pool": 16, "mode": "reserve"}])
            },
        ),
        ("cell_groups", "expected a list of cell groups", |v| {
            v["cell_groups"] = json!({"name": "x"})
        }),
    ];
    for (field, problem, edit) in cases {
        let mut fleet = base();
        edit(&mut fleet);
        check_error(&fleet, field, problem);
    }
}

#[test]
fn toml_errors_name_the_field_too() {
    let text = "max_connections = 500\nreserve = 10\n\n[[cell_groups]]\nname = \"a\"\ncount = 2\n\
                pool = 0\nmode = \"db\"\n";
    let err = budget::parse_fleet(text, Format::Toml, "case.toml").unwrap_err();
    assert_eq!(
        err.to_string(),
        "cell_groups[0].pool: expected a positive integer, got 0"
    );
}

#[test]
fn unreadable_and_malformed_files_name_the_file() {
    let missing = std::env::temp_dir().join("orca-relay-no-such-fleet.json");
    let err = budget::run_file(&missing).unwrap_err();
    assert!(matches!(err, BudgetError::Read { .. }), "{err:?}");
    assert!(
        err.to_string().contains("orca-relay-no-such-fleet.json"),
        "{err}"
    );

    let path = temp_file("json", "{\"max_connections\": 500,");
    let err = budget::run_file(&path).unwrap_err();
    assert!(matches!(err, BudgetError::Syntax { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains(&path.display().to_string()), "{message}");
    assert!(message.contains("invalid JSON"), "{message}");
    let _ = std::fs::remove_file(path);

    let path = temp_file("fleet", "max_connections = [");
    let message = budget::run_file(&path).unwrap_err().to_string();
    assert!(message.contains("neither JSON"), "{message}");
    let _ = std::fs::remove_file(path);
}

#[test]
fn a_fleet_path_that_is_no_small_regular_file_is_refused_without_reading_it() {
    let dir = temp_file("dir", "");
    std::fs::remove_file(&dir).unwrap();
    std::fs::create_dir(&dir).unwrap();
    let zero = dir.join("zero.json");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    let fifo = dir.join("fifo.json");
    let c_path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates a node.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    let big = dir.join("big.json");
    std::fs::write(&big, vec![b' '; 65 * 1024]).unwrap();
    // Before: /dev/zero grew the tool without end, the FIFO blocked it for good.
    for (path, says) in [
        (&zero, "not a regular file but a character_device"),
        (&fifo, "not a regular file but a fifo"),
        (&dir, "not a regular file but a directory"),
        (&big, "too large (66560 bytes, at most 65536)"),
    ] {
        let err = budget::run_file(path).unwrap_err();
        assert!(matches!(err, BudgetError::Read { .. }), "{err:?}");
        assert!(err.to_string().ends_with(says), "{err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

fn temp_file(extension: &str, text: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "orca-relay-budget-{}-{}.{extension}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&path, text).unwrap();
    path
}
