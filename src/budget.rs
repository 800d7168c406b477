//! The connection budget tool (SPEC §10): `orca-relay budget FILE`.
//!
//! Owns the arithmetic of seed `dead-man-trip-slots.md`: how many PostgreSQL connections a fleet
//! of cells, directors and other consumers may hold at once, with and without
//! `deadManTripSlots`. It reads a fleet file (JSON or TOML), resolves its scenarios, and renders
//! one aligned row per scenario.
//!
//! Runs on the main thread of the `budget` command, once. It is pure apart from
//! [`run_file`] reading the one file: it never opens a database, never reads the environment and
//! never spawns a thread.
//!
//! # The arithmetic
//!
//! - Without slots every cell counts at its full pool (every cell may trip to `db` at once).
//! - With `dead_man_trip_slots = S`, `db`-mode cells still count at their full pool, `reserve`
//!   cells count at their `measured_peak` (required then), plus `S` × the largest
//!   (pool − peak) over the reserve groups: at most `S` cells hold a slot and run on their full
//!   pool. `S` is capped at the number of reserve cells, since one cell holds at most one slot.
//! - Operating = cells + fixed consumers; usable = `max_connections` − `reserve`;
//!   spare = usable − operating (negative means over budget).
//!
//! A peak is an estimate unless the cells enforce it with
//! `ORCA_RELAY_DATABASE_POOL_RESERVE_MAX` (SPEC §5.5); then the slot rows are a guarantee.
//!
//! # The cells line
//!
//! Without slots, one `count`x`pool` term per pool size (`6x10 + 16x8 + 7x16 = 300`). With
//! slots: the `db` cells' total, the total of reserve cells whose peak equals their pool, one
//! `count`x`peak` term per peak below the pool, and `slots`x`headroom`
//! (`76 + 128 + 8x12 + 2x4 = 308`, the seed's own breakdown).
//!
//! # The fleet file
//!
//! Every table may also hold a `comment` (ignored), since JSON has no comments.
//!
//! ```toml
//! name = "seed fleet"            # optional, names the first row
//! max_connections = 500          # required
//! reserve = 10                   # required: the explicit reserve, 0 for none
//! dead_man_trip_slots = 2        # optional, 0-64 (also spelled deadManTripSlots)
//! [fixed_consumers]              # optional: name = connections
//! directors = 15
//! [[cell_groups]]                # name, count, pool, mode (db|reserve), optional measured_peak
//! name = "asia"
//! count = 7
//! pool = 16
//! mode = "reserve"
//! measured_peak = 12
//! [[scenarios]]                  # optional; each is one more row
//! name = "plus two Asia cells"
//! extends = "an earlier scenario" # optional; default: the base fleet
//! dead_man_trip_slots = 2        # optional: set the slots
//! add_groups = [ ... ]           # optional: more cell groups
//! flip_to_db = [ { group = "asia", count = 2 } ]  # optional: deliberate db flips, full pool
//! ```

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// The largest `deadManTripSlots` a cell accepts (SPEC §5.1).
pub const MAX_TRIP_SLOTS: u64 = 64;

/// The largest pool a cell accepts (`ORCA_RELAY_DATABASE_POOL_MAX`, SPEC §4).
pub const MAX_POOL: u64 = 100;

/// Why a fleet file could not be read or planned. Every message names what to fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BudgetError {
    /// The file could not be read.
    Read { path: PathBuf, message: String },
    /// The file is not valid JSON or TOML.
    Syntax { source: String, message: String },
    /// A field is missing, has the wrong type, or is out of range.
    Field { field: String, problem: String },
}

impl BudgetError {
    fn field(field: impl Into<String>, problem: impl Into<String>) -> BudgetError {
        BudgetError::Field {
            field: field.into(),
            problem: problem.into(),
        }
    }

    /// The field path (`cell_groups[2].pool`) for a field error.
    pub fn field_path(&self) -> Option<&str> {
        match self {
            BudgetError::Field { field, .. } => Some(field),
            _ => None,
        }
    }
}

impl fmt::Display for BudgetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BudgetError::Read { path, message } => {
                write!(f, "cannot read fleet file {}: {message}", path.display())
            }
            BudgetError::Syntax { source, message } => write!(f, "{source}: {message}"),
            BudgetError::Field { field, problem } => write!(f, "{field}: {problem}"),
        }
    }
}

impl std::error::Error for BudgetError {}

/// The file formats a fleet may be written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Toml,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Db,
    Reserve,
}

/// Cells that share a pool size, a mode and a measured peak.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellGroup {
    pub name: String,
    pub count: u64,
    pub pool: u64,
    pub mode: Mode,
    pub measured_peak: Option<u64>,
    /// Where the group was written (`cell_groups[3]`), so errors found later point at it.
    pub source: String,
}

/// A deliberate `db` flip of some cells of a reserve group (an image roll batch). Flipped cells
/// are outside the slot cap and count at their full pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flip {
    pub group: String,
    pub count: u64,
    pub source: String,
}

/// A named variation of the fleet: one more row of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scenario {
    pub name: String,
    /// An earlier scenario this one starts from; `None` starts from the base fleet.
    pub extends: Option<String>,
    pub dead_man_trip_slots: Option<u64>,
    pub add_groups: Vec<CellGroup>,
    pub flip_to_db: Vec<Flip>,
    pub source: String,
}

/// A parsed fleet file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fleet {
    /// The name of the base fleet's row.
    pub name: String,
    pub max_connections: u64,
    /// The explicit reserve kept free for superuser and emergency connections.
    pub reserve: u64,
    /// Everything that is not a cell (directors, auth, API, rollout overlap, maintenance).
    pub fixed_consumers: Vec<(String, u64)>,
    pub cell_groups: Vec<CellGroup>,
    pub dead_man_trip_slots: Option<u64>,
    pub scenarios: Vec<Scenario>,
}

/// One term of a cells line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Term {
    /// A total of connections (`76`).
    Total(u64),
    /// `count` cells (or slots) at `each` connections (`8x12`).
    Each { count: u64, each: u64 },
}

impl Term {
    pub fn connections(self) -> u64 {
        match self {
            Term::Total(total) => total,
            Term::Each { count, each } => count * each,
        }
    }
}

impl fmt::Display for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Term::Total(total) => write!(f, "{total}"),
            Term::Each { count, each } => write!(f, "{count}x{each}"),
        }
    }
}

/// One row of the table: the base fleet or one scenario.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub scenario: String,
    pub dead_man_trip_slots: Option<u64>,
    pub terms: Vec<Term>,
    pub cells: u64,
    pub operating: u64,
    pub spare: i64,
}

impl Row {
    /// The cells line, e.g. `76 + 128 + 8x12 + 2x4 = 308`.
    pub fn cells_line(&self) -> String {
        match self.terms.as_slice() {
            [] => "0".to_string(),
            [Term::Total(total)] => total.to_string(),
            terms => {
                let sum: Vec<String> = terms.iter().map(Term::to_string).collect();
                format!("{} = {}", sum.join(" + "), self.cells)
            }
        }
    }
}

/// The budget of a fleet: the shared figures and one row per scenario.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub fleet_name: String,
    pub max_connections: u64,
    pub reserve: u64,
    pub usable: u64,
    pub fixed_consumers: Vec<(String, u64)>,
    pub fixed_total: u64,
    pub rows: Vec<Row>,
}

// ---------------------------------------------------------------------------------------------
// Reading the file.

/// What `orca-relay budget FILE` prints: reads, parses, plans and renders one fleet file.
pub fn run_file(path: &Path) -> Result<String, BudgetError> {
    // A regular file of at most 64 KiB: a fleet is a few dozen lines, and a FIFO or a device
    // named by mistake must not hang or exhaust the tool.
    let text =
        crate::local_file::read_bounded_to_string(path, crate::local_file::MAX_LOCAL_FILE_BYTES)
            .map_err(|e| BudgetError::Read {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
    let format = match path.extension().and_then(|e| e.to_str()) {
        Some(ext) if ext.eq_ignore_ascii_case("json") => Some(Format::Json),
        Some(ext) if ext.eq_ignore_ascii_case("toml") => Some(Format::Toml),
        _ => None,
    };
    let source = path.display().to_string();
    let fleet = match format {
        Some(format) => parse_fleet(&text, format, &source)?,
        None => parse_fleet_any(&text, &source)?,
    };
    Ok(format!("fleet file: {source}\n{}", render(&plan(&fleet)?)))
}

/// Parses a fleet written in `format`; `source` names the file in syntax errors.
pub fn parse_fleet(text: &str, format: Format, source: &str) -> Result<Fleet, BudgetError> {
    let value = match format {
        Format::Json => serde_json::from_str::<Value>(text).map_err(|e| BudgetError::Syntax {
            source: source.to_string(),
            message: format!("invalid JSON: {e}"),
        })?,
        Format::Toml => toml_to_json(text).map_err(|message| BudgetError::Syntax {
            source: source.to_string(),
            message: format!("invalid TOML: {message}"),
        })?,
    };
    fleet_from_value(&value)
}

/// Parses a fleet whose format is unknown: JSON first, then TOML.
pub fn parse_fleet_any(text: &str, source: &str) -> Result<Fleet, BudgetError> {
    match serde_json::from_str::<Value>(text) {
        Ok(value) => fleet_from_value(&value),
        Err(json_error) => match toml_to_json(text) {
            Ok(value) => fleet_from_value(&value),
            Err(toml_error) => Err(BudgetError::Syntax {
                source: source.to_string(),
                message: format!(
                    "neither JSON ({json_error}) nor TOML ({})",
                    toml_error.trim_end()
                ),
            }),
        },
    }
}

fn toml_to_json(text: &str) -> Result<Value, String> {
    let table: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
    serde_json::to_value(table).map_err(|e| e.to_string())
}

/// An object being read, with its path for error messages.
struct Object<'a> {
    path: String,
    map: &'a Map<String, Value>,
}

impl<'a> Object<'a> {
    fn new(value: &'a Value, path: &str, known: &[&str]) -> Result<Object<'a>, BudgetError> {
        let map = value.as_object().ok_or_else(|| {
            BudgetError::field(
                display_path(path),
                format!("expected a table/object, got {}", describe(value)),
            )
        })?;
        // `comment` is allowed everywhere: JSON has no comments, and the example files explain
        // themselves.
        if let Some(unknown) = map
            .keys()
            .find(|key| *key != "comment" && !known.contains(&key.as_str()))
        {
            return Err(BudgetError::field(
                join(path, unknown),
                format!("unknown field, expected one of {}", known.join(", ")),
            ));
        }
        Ok(Object {
            path: path.to_string(),
            map,
        })
    }

    fn field(&self, key: &str) -> String {
        join(&self.path, key)
    }

    /// The value of the first present spelling, with the path of that spelling.
    fn get(&self, keys: &[&str]) -> Option<(String, &'a Value)> {
        keys.iter()
            .find_map(|key| self.map.get(*key).map(|value| (self.field(key), value)))
    }

    fn required(&self, key: &str, what: &str) -> Result<(String, &'a Value), BudgetError> {
        self.get(&[key])
            .ok_or_else(|| BudgetError::field(self.field(key), format!("missing, expected {what}")))
    }

    fn string(&self, key: &str) -> Result<String, BudgetError> {
        let (field, value) = self.required(key, "a non-empty string")?;
        match value.as_str().map(str::trim) {
            Some(s) if !s.is_empty() => Ok(s.to_string()),
            _ => Err(BudgetError::field(
                field,
                format!("expected a non-empty string, got {}", describe(value)),
            )),
        }
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn display_path(path: &str) -> &str {
    if path.is_empty() {
        "(top level)"
    } else {
        path
    }
}

fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("the string {s:?}"),
        Value::Array(_) => "a list".to_string(),
        Value::Object(_) => "a table/object".to_string(),
    }
}

/// An integer in `min..=max`. Messages say "positive" or "non-negative" where that is the whole
/// rule, so a negative or fractional count reads as what it is.
fn integer(field: &str, value: &Value, min: u64, max: Option<u64>) -> Result<u64, BudgetError> {
    let expected = match (min, max) {
        (0, None) => "a non-negative integer".to_string(),
        (1, None) => "a positive integer".to_string(),
        (min, None) => format!("an integer of at least {min}"),
        (min, Some(max)) => format!("an integer from {min} to {max}"),
    };
    match value.as_u64() {
        Some(n) if n >= min && max.is_none_or(|max| n <= max) => Ok(n),
        _ => Err(BudgetError::field(
            field,
            format!("expected {expected}, got {}", describe(value)),
        )),
    }
}

fn slots(field: &str, value: &Value) -> Result<u64, BudgetError> {
    integer(field, value, 0, Some(MAX_TRIP_SLOTS))
}

const SLOT_KEYS: &[&str] = &["dead_man_trip_slots", "deadManTripSlots"];

fn fleet_from_value(value: &Value) -> Result<Fleet, BudgetError> {
    let top = Object::new(
        value,
        "",
        &[
            "name",
            "max_connections",
            "reserve",
            "fixed_consumers",
            "cell_groups",
            "dead_man_trip_slots",
            "deadManTripSlots",
            "scenarios",
        ],
    )?;
    let name = match top.get(&["name"]) {
        None => "fleet".to_string(),
        Some(_) => top.string("name")?,
    };
    let (field, value) = top.required("max_connections", "a positive integer")?;
    let max_connections = integer(&field, value, 1, None)?;
    let (field, value) = top.required("reserve", "a non-negative integer (0 for none)")?;
    let reserve = integer(&field, value, 0, None)?;
    if reserve >= max_connections {
        return Err(BudgetError::field(
            field,
            format!("{reserve} leaves nothing of max_connections {max_connections}"),
        ));
    }

    let mut fixed_consumers = Vec::new();
    if let Some((field, value)) = top.get(&["fixed_consumers"]) {
        let map = value.as_object().ok_or_else(|| {
            BudgetError::field(
                &field,
                format!(
                    "expected a table/object of name = connections, got {}",
                    describe(value)
                ),
            )
        })?;
        for (name, connections) in map.iter().filter(|(name, _)| *name != "comment") {
            let connections = integer(&join(&field, name), connections, 0, None)?;
            fixed_consumers.push((name.clone(), connections));
        }
    }

    let cell_groups = match top.get(&["cell_groups"]) {
        None => Vec::new(),
        Some((field, value)) => groups(&field, value)?,
    };
    check_unique_names(&cell_groups)?;

    let dead_man_trip_slots = match top.get(SLOT_KEYS) {
        None => None,
        Some((field, value)) => Some(slots(&field, value)?),
    };

    let mut scenarios: Vec<Scenario> = Vec::new();
    if let Some((field, value)) = top.get(&["scenarios"]) {
        let list = value.as_array().ok_or_else(|| {
            BudgetError::field(&field, format!("expected a list, got {}", describe(value)))
        })?;
        for (index, item) in list.iter().enumerate() {
            let scenario = scenario(&format!("{field}[{index}]"), item)?;
            if scenario.name == name || scenarios.iter().any(|s| s.name == scenario.name) {
                return Err(BudgetError::field(
                    join(&scenario.source, "name"),
                    format!("{:?} names an earlier row", scenario.name),
                ));
            }
            if let Some(extends) = &scenario.extends {
                if *extends != name && !scenarios.iter().any(|s| s.name == *extends) {
                    return Err(BudgetError::field(
                        join(&scenario.source, "extends"),
                        format!("{extends:?} is neither the fleet nor an earlier scenario"),
                    ));
                }
            }
            scenarios.push(scenario);
        }
    }

    Ok(Fleet {
        name,
        max_connections,
        reserve,
        fixed_consumers,
        cell_groups,
        dead_man_trip_slots,
        scenarios,
    })
}

fn groups(field: &str, value: &Value) -> Result<Vec<CellGroup>, BudgetError> {
    let list = value.as_array().ok_or_else(|| {
        BudgetError::field(
            field,
            format!("expected a list of cell groups, got {}", describe(value)),
        )
    })?;
    list.iter()
        .enumerate()
        .map(|(index, item)| group(&format!("{field}[{index}]"), item))
        .collect()
}

fn group(path: &str, value: &Value) -> Result<CellGroup, BudgetError> {
    let object = Object::new(
        value,
        path,
        &["name", "count", "pool", "mode", "measured_peak"],
    )?;
    let name = object.string("name")?;
    let (field, value) = object.required("count", "a non-negative integer")?;
    let count = integer(&field, value, 0, None)?;
    let (field, value) = object.required("pool", "a positive integer")?;
    let pool = match value.as_u64() {
        Some(pool) if pool > MAX_POOL => {
            return Err(BudgetError::field(
                field,
                format!("{pool} is above {MAX_POOL}, the largest ORCA_RELAY_DATABASE_POOL_MAX"),
            ))
        }
        _ => integer(&field, value, 1, None)?,
    };
    let (field, value) = object.required("mode", "\"db\" or \"reserve\"")?;
    let mode = match value.as_str() {
        Some("db") => Mode::Db,
        Some("reserve") => Mode::Reserve,
        _ => {
            return Err(BudgetError::field(
                field,
                format!(
                    "unknown mode {}, expected \"db\" or \"reserve\"",
                    describe(value)
                ),
            ))
        }
    };
    let measured_peak = match object.get(&["measured_peak"]) {
        None => None,
        Some((field, value)) => {
            let peak = integer(&field, value, 0, None)?;
            if peak > pool {
                return Err(BudgetError::field(
                    field,
                    format!("{peak} is above the group's pool of {pool}"),
                ));
            }
            Some(peak)
        }
    };
    Ok(CellGroup {
        name,
        count,
        pool,
        mode,
        measured_peak,
        source: path.to_string(),
    })
}

fn check_unique_names(groups: &[CellGroup]) -> Result<(), BudgetError> {
    for (index, group) in groups.iter().enumerate() {
        if let Some(first) = groups[..index].iter().find(|g| g.name == group.name) {
            return Err(BudgetError::field(
                join(&group.source, "name"),
                format!("{:?} is already the name of {}", group.name, first.source),
            ));
        }
    }
    Ok(())
}

fn scenario(path: &str, value: &Value) -> Result<Scenario, BudgetError> {
    let object = Object::new(
        value,
        path,
        &[
            "name",
            "extends",
            "dead_man_trip_slots",
            "deadManTripSlots",
            "add_groups",
            "flip_to_db",
        ],
    )?;
    let name = object.string("name")?;
    let extends = match object.get(&["extends"]) {
        None => None,
        Some(_) => Some(object.string("extends")?),
    };
    let dead_man_trip_slots = match object.get(SLOT_KEYS) {
        None => None,
        Some((field, value)) => Some(slots(&field, value)?),
    };
    let add_groups = match object.get(&["add_groups"]) {
        None => Vec::new(),
        Some((field, value)) => groups(&field, value)?,
    };
    let mut flip_to_db = Vec::new();
    if let Some((field, value)) = object.get(&["flip_to_db"]) {
        let list = value.as_array().ok_or_else(|| {
            BudgetError::field(
                &field,
                format!(
                    "expected a list of {{group, count}}, got {}",
                    describe(value)
                ),
            )
        })?;
        for (index, item) in list.iter().enumerate() {
            let item_path = format!("{field}[{index}]");
            let flip = Object::new(item, &item_path, &["group", "count"])?;
            let group = flip.string("group")?;
            let (count_field, count) = flip.required("count", "a positive integer")?;
            let count = integer(&count_field, count, 1, None)?;
            flip_to_db.push(Flip {
                group,
                count,
                source: item_path,
            });
        }
    }
    Ok(Scenario {
        name,
        extends,
        dead_man_trip_slots,
        add_groups,
        flip_to_db,
        source: path.to_string(),
    })
}

// ---------------------------------------------------------------------------------------------
// The arithmetic.

/// The cells of one row after a scenario's changes.
#[derive(Clone)]
struct Resolved {
    groups: Vec<CellGroup>,
    slots: Option<u64>,
}

/// Resolves every scenario and computes one row each (the base fleet first).
pub fn plan(fleet: &Fleet) -> Result<Plan, BudgetError> {
    let fixed_total: u64 = fleet.fixed_consumers.iter().map(|(_, n)| n).sum();
    let usable = fleet.max_connections.saturating_sub(fleet.reserve);

    let base = Resolved {
        groups: fleet.cell_groups.clone(),
        slots: fleet.dead_man_trip_slots,
    };
    let mut resolved: Vec<(String, Resolved)> = vec![(fleet.name.clone(), base)];
    for scenario in &fleet.scenarios {
        let start = scenario.extends.as_deref().unwrap_or(&fleet.name);
        let mut state = resolved
            .iter()
            .find(|(name, _)| name == start)
            .map(|(_, state)| state.clone())
            .ok_or_else(|| {
                BudgetError::field(
                    join(&scenario.source, "extends"),
                    format!("{start:?} is neither the fleet nor an earlier scenario"),
                )
            })?;
        apply(&mut state, scenario)?;
        resolved.push((scenario.name.clone(), state));
    }

    let rows = resolved
        .iter()
        .map(|(name, state)| {
            let (terms, cells) = cells_line(state)?;
            let operating = cells + fixed_total;
            Ok(Row {
                scenario: name.clone(),
                dead_man_trip_slots: state.slots,
                terms,
                cells,
                operating,
                spare: usable as i64 - operating as i64,
            })
        })
        .collect::<Result<Vec<_>, BudgetError>>()?;

    Ok(Plan {
        fleet_name: fleet.name.clone(),
        max_connections: fleet.max_connections,
        reserve: fleet.reserve,
        usable,
        fixed_consumers: fleet.fixed_consumers.clone(),
        fixed_total,
        rows,
    })
}

fn apply(state: &mut Resolved, scenario: &Scenario) -> Result<(), BudgetError> {
    if let Some(slots) = scenario.dead_man_trip_slots {
        state.slots = Some(slots);
    }
    state.groups.extend(scenario.add_groups.iter().cloned());
    check_unique_names(&state.groups)?;
    for flip in &scenario.flip_to_db {
        let field = join(&flip.source, "group");
        let index = state
            .groups
            .iter()
            .position(|g| g.name == flip.group)
            .ok_or_else(|| {
                BudgetError::field(&field, format!("no cell group named {:?}", flip.group))
            })?;
        let group = &mut state.groups[index];
        if group.mode != Mode::Reserve {
            return Err(BudgetError::field(
                field,
                format!("{:?} is already in db mode", flip.group),
            ));
        }
        if flip.count > group.count {
            return Err(BudgetError::field(
                join(&flip.source, "count"),
                format!(
                    "{} is more than the {} cells of {:?}",
                    flip.count, group.count, flip.group
                ),
            ));
        }
        group.count -= flip.count;
        let flipped_name = format!("{} (flipped to db)", flip.group);
        let pool = group.pool;
        match state.groups.iter_mut().find(|g| g.name == flipped_name) {
            Some(flipped) => flipped.count += flip.count,
            None => state.groups.push(CellGroup {
                name: flipped_name,
                count: flip.count,
                pool,
                mode: Mode::Db,
                measured_peak: None,
                source: flip.source.clone(),
            }),
        }
    }
    Ok(())
}

/// Adds `count` to the term for `key`, keeping terms in order of first appearance.
fn add_count(terms: &mut Vec<(u64, u64)>, key: u64, count: u64) {
    match terms.iter_mut().find(|(k, _)| *k == key) {
        Some((_, total)) => *total += count,
        None => terms.push((key, count)),
    }
}

fn cells_line(state: &Resolved) -> Result<(Vec<Term>, u64), BudgetError> {
    let groups: Vec<&CellGroup> = state.groups.iter().filter(|g| g.count > 0).collect();
    let terms = match state.slots {
        None => {
            // Every cell may trip at once: each counts at its full pool.
            let mut by_pool = Vec::new();
            for group in &groups {
                add_count(&mut by_pool, group.pool, group.count);
            }
            by_pool
                .into_iter()
                .map(|(pool, count)| Term::Each { count, each: pool })
                .collect()
        }
        Some(slots) => {
            let mut db_total = 0;
            let mut reserve_at_pool = 0;
            let mut reserve_by_peak = Vec::new();
            let mut reserve_cells = 0;
            let mut headroom = 0;
            for group in &groups {
                match group.mode {
                    Mode::Db => db_total += group.count * group.pool,
                    Mode::Reserve => {
                        let peak = group.measured_peak.ok_or_else(|| {
                            BudgetError::field(
                                join(&group.source, "measured_peak"),
                                format!(
                                    "missing for reserve group {:?}: required when \
                                     dead_man_trip_slots is set",
                                    group.name
                                ),
                            )
                        })?;
                        if peak == group.pool {
                            reserve_at_pool += group.count * group.pool;
                        } else {
                            add_count(&mut reserve_by_peak, peak, group.count);
                        }
                        reserve_cells += group.count;
                        headroom = headroom.max(group.pool - peak);
                    }
                }
            }
            // One cell holds at most one slot.
            let slot_holders = slots.min(reserve_cells);
            let mut terms = Vec::new();
            if db_total > 0 {
                terms.push(Term::Total(db_total));
            }
            if reserve_at_pool > 0 {
                terms.push(Term::Total(reserve_at_pool));
            }
            terms.extend(
                reserve_by_peak
                    .into_iter()
                    .map(|(peak, count)| Term::Each { count, each: peak }),
            );
            if slot_holders > 0 && headroom > 0 {
                terms.push(Term::Each {
                    count: slot_holders,
                    each: headroom,
                });
            }
            terms
        }
    };
    let cells = terms.iter().map(|t| t.connections()).sum();
    Ok((terms, cells))
}

// ---------------------------------------------------------------------------------------------
// The output.

/// The table `orca-relay budget` prints.
pub fn render(plan: &Plan) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "max_connections {} - explicit reserve {} = usable {}\n",
        plan.max_connections, plan.reserve, plan.usable
    ));
    if plan.fixed_consumers.is_empty() {
        out.push_str("fixed consumers: none\n");
    } else {
        let parts: Vec<String> = plan
            .fixed_consumers
            .iter()
            .map(|(name, n)| format!("{name} {n}"))
            .collect();
        out.push_str(&format!(
            "fixed consumers: {} = {}\n",
            parts.join(" + "),
            plan.fixed_total
        ));
    }
    out.push('\n');

    let header = [
        "scenario",
        "slots",
        "cells line",
        "operating",
        "usable",
        "spare",
    ];
    let cells: Vec<[String; 6]> = plan
        .rows
        .iter()
        .map(|row| {
            [
                row.scenario.clone(),
                row.dead_man_trip_slots
                    .map_or_else(|| "-".to_string(), |s| s.to_string()),
                row.cells_line(),
                row.operating.to_string(),
                plan.usable.to_string(),
                row.spare.to_string(),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &cells {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let header: [String; 6] = header.map(str::to_string);
    for row in std::iter::once(&header).chain(&cells) {
        let mut line = String::new();
        for (column, (cell, width)) in row.iter().zip(widths).enumerate() {
            if column > 0 {
                line.push_str("  ");
            }
            // Text columns align left, numbers right.
            if column <= 2 {
                line.push_str(&format!("{cell:<width$}"));
            } else {
                line.push_str(&format!("{cell:>width$}"));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }

    if plan.rows.iter().any(|r| r.dead_man_trip_slots.is_some()) {
        out.push_str(
            "\nwith slots: db cells at their full pool, reserve cells at their measured peak, \
             plus slots x the largest (pool - peak);\na measured peak is an estimate unless \
             ORCA_RELAY_DATABASE_POOL_RESERVE_MAX enforces it as the reserve-mode ceiling\n",
        );
    }
    let over: Vec<&str> = plan
        .rows
        .iter()
        .filter(|r| r.spare < 0)
        .map(|r| r.scenario.as_str())
        .collect();
    if !over.is_empty() {
        out.push_str(&format!("\nover budget: {}\n", over.join(", ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(name: &str, count: u64, pool: u64, mode: Mode, peak: Option<u64>) -> CellGroup {
        CellGroup {
            name: name.into(),
            count,
            pool,
            mode,
            measured_peak: peak,
            source: format!("cell_groups[{name}]"),
        }
    }

    fn fleet(groups: Vec<CellGroup>, slots: Option<u64>) -> Fleet {
        Fleet {
            name: "f".into(),
            max_connections: 500,
            reserve: 10,
            fixed_consumers: vec![("directors".into(), 15), ("auth".into(), 20)],
            cell_groups: groups,
            dead_man_trip_slots: slots,
            scenarios: Vec::new(),
        }
    }

    #[test]
    fn without_slots_every_cell_counts_at_its_pool() {
        let plan = plan(&fleet(
            vec![
                group("a", 2, 10, Mode::Db, None),
                group("b", 3, 16, Mode::Reserve, Some(12)),
            ],
            None,
        ))
        .unwrap();
        let row = &plan.rows[0];
        assert_eq!(row.cells_line(), "2x10 + 3x16 = 68");
        assert_eq!(row.operating, 68 + 35);
        assert_eq!(row.spare, 490 - 103);
    }

    #[test]
    fn slots_count_reserve_cells_at_peak_plus_headroom() {
        let plan = plan(&fleet(
            vec![
                group("a", 2, 10, Mode::Db, None),
                group("us", 4, 8, Mode::Reserve, Some(8)),
                group("b", 3, 16, Mode::Reserve, Some(12)),
                group("c", 1, 20, Mode::Reserve, Some(15)),
            ],
            Some(2),
        ))
        .unwrap();
        // Headroom is the largest pool - peak: 20 - 15 = 5.
        assert_eq!(
            plan.rows[0].cells_line(),
            "20 + 32 + 3x12 + 1x15 + 2x5 = 113"
        );
    }

    #[test]
    fn slots_are_capped_at_the_number_of_reserve_cells() {
        let plan = plan(&fleet(
            vec![group("b", 1, 16, Mode::Reserve, Some(12))],
            Some(5),
        ))
        .unwrap();
        assert_eq!(plan.rows[0].cells_line(), "1x12 + 1x4 = 16");
    }

    #[test]
    fn zero_slots_never_trip_so_no_headroom() {
        let plan = plan(&fleet(
            vec![group("b", 3, 16, Mode::Reserve, Some(12))],
            Some(0),
        ))
        .unwrap();
        assert_eq!(plan.rows[0].cells_line(), "3x12 = 36");
    }

    #[test]
    fn slots_need_every_reserve_peak() {
        let err = plan(&fleet(
            vec![
                group("a", 2, 10, Mode::Db, None),
                group("b", 3, 16, Mode::Reserve, None),
            ],
            Some(2),
        ))
        .unwrap_err();
        assert_eq!(err.field_path(), Some("cell_groups[b].measured_peak"));
        assert!(err.to_string().contains("\"b\""), "{err}");
    }

    #[test]
    fn over_budget_is_negative_spare_and_flagged() {
        let plan = plan(&fleet(vec![group("a", 50, 10, Mode::Db, None)], None)).unwrap();
        assert_eq!(plan.rows[0].spare, 490 - 535);
        assert!(render(&plan).contains("over budget: f"));
    }

    #[test]
    fn integers_name_their_rule() {
        let err = integer("x", &serde_json::json!(-3), 0, None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "x: expected a non-negative integer, got -3"
        );
        let err = integer("x", &serde_json::json!(2.5), 1, None).unwrap_err();
        assert_eq!(err.to_string(), "x: expected a positive integer, got 2.5");
    }
}
