//! Subcommands: `run`, `migrate`, `check-config`, `budget FILE`, `client host|phone`,
//! `switch show|set|re-arm`, `fleet status`.
//!
//! Arguments are parsed once into a [`Command`]; each command returns its exit code.

use crate::client::{HostOptions, PhoneOptions};
use crate::config::Config;

pub const HELP: &str = "\
orca-relay: a WebSocket relay for desktops and their paired phones

usage:
  orca-relay [run]              run the role from ORCA_RELAY_ROLE (combined, cell, director)
  orca-relay migrate            apply sql/ migrations to the configured database
  orca-relay check-config       validate the environment (every problem in one run) and print
                                the effective configuration
  orca-relay budget FILE        print the database connection budget of a fleet (JSON or TOML)
  orca-relay client host [--director URL] [--relay-host-id ID] [--user-id ID] [--token JWT]
                                a desktop peer: gets a placement, holds a control socket,
                                prints the phone's command and echoes what phones send;
                                follows drains back to the director; stops on SIGINT/SIGTERM
  orca-relay client phone --cell URL --relay-host-id ID --invite TOKEN
                                a phone peer: pipes stdin to the desktop and its answers to stdout
  orca-relay switch show | set --admit-mode reserve|db [--trip-slots N] | re-arm
                                read or write this cell's switch file (next generation, atomic)
  orca-relay handover [--binary PATH]
                                replace the running relay with the binary on disk (and this
                                environment) without closing a connection; systemctl reload
  orca-relay fleet status [--director URL] [--json]
                                every cell the director knows, one table row each, and a
                                summary line (dead-man states, trip slots taken)
  orca-relay --help | --version
  orca-relay COMMAND --help     help on one command

Configuration comes from the environment (ORCA_RELAY_*, DATABASE_URL, RUST_LOG); on a VM the
systemd unit reads it from /etc/orca-relay/<role>.env (examples in packaging/). An empty value
means unset. With no configuration at all, `orca-relay` runs the combined role on SQLite under
./data with a generated self-hosted key.
";

const RUN_HELP: &str = "\
usage: orca-relay run    (or orca-relay with no arguments)

Runs the role named by ORCA_RELAY_ROLE (combined, cell, director) until SIGTERM, which drains.
Configuration comes from the environment (see `orca-relay check-config --help` and
docs/CONFIGURATION.md). A bad configuration stops it with one line per problem.
";

const MIGRATE_HELP: &str = "\
usage: orca-relay migrate

Applies the sql/ migrations to the configured database (DATABASE_URL, or SQLite under
ORCA_RELAY_DATA_DIR), idempotently. Safe while other processes migrate the same database.
";

const CHECK_CONFIG_HELP: &str = "\
usage: orca-relay check-config

Validates the environment the way `run` does. Valid: prints every variable with its effective
value (secrets masked, (unset) where a variable has no value) and a last line
`config ok: role=... (N variables set)`; exit 0. Not valid: lists every problem, one line each
(`missing X (unset)` for a required variable, `invalid X=\"value\"` with the accepted range),
then `N problems`; exit 1.
";

const BUDGET_HELP: &str = "\
usage: orca-relay budget FILE

Prints the database connection budget of a fleet described in FILE (JSON or TOML), with and
without deadManTripSlots. packaging/fleet-seed.json is an example.
";

const CLIENT_HELP: &str = "\
usage: orca-relay client host [--director URL] [--relay-host-id ID] [--user-id ID] [--token JWT]
       orca-relay client phone --cell URL --relay-host-id ID --invite TOKEN

Small peers for trying a relay by hand; see `client host --help` and `client phone --help`.
";

const CLIENT_HOST_HELP: &str = "\
usage: orca-relay client host [--director URL] [--relay-host-id ID] [--user-id ID] [--token JWT]

A desktop peer. Asks the director for a placement (POST /v1/assign), holds a control socket on
the cell it names, prints the command a phone runs (with a fresh invite) on stdout, and echoes
every frame a phone sends. On a drain frame, a 4503 or 4409 close, a refused upgrade or a lost
connection it asks the director again and reconnects (printing a new phone command), backing
off while nothing answers. Stops on SIGINT or SIGTERM (exit 0); exits 1 on a refused token or a
newer control for the same host. Standard input is not read.

  --director URL        director base URL (default http://<ORCA_RELAY_HTTP_ADDR>)
  --relay-host-id ID    16 characters [A-Za-z0-9_-] (default: random)
  --user-id ID          the token's subject (default local-user)
  --token JWT           a desktop token; by default one is minted from the combined role's
                        self-hosted key (ORCA_RELAY_SELF_HOSTED_KEY or
                        $ORCA_RELAY_DATA_DIR/self-hosted.key)
";

const SWITCH_HELP: &str = "\
usage: orca-relay switch show
       orca-relay switch set [--admit-mode reserve|db] [--trip-slots N|none] [--generation N]
       orca-relay switch re-arm [--generation N]

Reads and writes this cell's switch file, run on the cell's machine with the cell's
configuration (ORCA_RELAY_CELL_ID; ORCA_RELAY_SWITCH_FILE or $ORCA_RELAY_DATA_DIR/switch.json;
ORCA_RELAY_HTTP_ADDR to ask the running cell what it applied), as the cell's user or root.

  show      the file (generation and flags, or why the cell ignores it) and what the running
            cell applied (generation, dead-man state, deadManTripSlots in force)
  set       writes the flags given (the others keep their values) at the next generation
            --admit-mode reserve|db   the admission mode
            --trip-slots N|none       deadManTripSlots, 0 to 64; none removes the cap
  re-arm    writes the same flags at the next generation: a tripped reserve cell re-arms
  --generation N   write this generation instead of the next one (it must be above the file's
                   and the running cell's)

A write is validated with the cell's own parser, takes one generation above both the file's
and the one the running cell applied, and is atomic (temporary file in the same directory,
fsync, rename). The command then waits for the running cell to apply it (two switch polls at
most) and exits 1 if it did not.
";

const FLEET_HELP: &str = "\
usage: orca-relay fleet status [--director URL] [--json]

Every cell the director knows (GET /v1/admin/cells with the service token), one row each:
CELL, REGION, STATE (ready, not ready, draining, retired), ADMIT RAW/EFF (the cell's raw
admission mode and what its admit-effective row says), DEAD-MAN (off, armed, held, tripped),
WINDOW LEFT (until an armed cell's window passes, as of its last report), SLOT (holds a trip
slot, as the claim counts it), TRIP SLOTS (deadManTripSlots in force, none = no cap), HEARTBEAT
(age), CONNS/CAP, DB POOL (connections in use / ceiling); `-` where the director has no data.
Then one summary line: cells by state, dead-man states, trip slots taken / the fleet's slots
(the largest deadManTripSlots in force). docs/OPERATIONS.md explains each column.

  --director URL   the director's base URL (default: the first of ORCA_RELAY_DIRECTOR_URLS,
                   else http://<ORCA_RELAY_HTTP_ADDR> when ORCA_RELAY_ROLE runs a director:
                   director or combined)
  --json           print the director's JSON listing as it came, for scripts

Authenticates with ORCA_RELAY_SERVICE_TOKEN (a combined relay serves the listing only when it
was started with one). The whole exchange has a 10 s deadline and the answer at most 8 MiB.
States are coloured only when stdout is a terminal and NO_COLOR is unset or empty. Exit 0 when
the fleet was read; otherwise one line naming the cause (unreachable, no answer within 10 s,
401, another status, a bad answer) and exit 1.
";

const HANDOVER_HELP: &str = "\
usage: orca-relay handover [--binary PATH]

Replaces the running relay (cell or combined) with the binary on disk without closing a
connection: an upgrade, or a changed env file (a token rotation step, a new cap, a new log
level), applied live. `systemctl reload orca-relay-cell` runs it. Run it with the relay's
configuration (the unit's environment): the next process gets this command's environment.

The running process is found through $ORCA_RELAY_DATA_DIR/handover.sock. The next process
reads its configuration and opens its store; only then does the running one pause, pass over
its listeners, every connection and its state, and exit once the next one has confirmed.
Streams pause for well under a second. If anything fails before that (a configuration the
next process refuses, a crash, a state it cannot read, 10 s without a confirmation), the
running process keeps every connection and serves on. A stop (SIGTERM) of the running
process before the commit rolls the handover back and that process drains.

Only a handover socket of this user is spoken to: a data directory another user owns or can
write to, or a socket whose listening process runs as another user, is refused.

  --binary PATH   start this binary instead of the one this command runs from

Exit 0 with one line (pids, version, connections and pairs moved, the pause) once the next
process owns everything; exit 1 with one line saying what happened otherwise (rolled back and
the running relay keeps serving, with the cause; nothing asked; or the running relay died during
the handover). The listening addresses, the role and the cell id cannot change this way (the
next process refuses them before anything pauses): restart for those.
";

const CLIENT_PHONE_HELP: &str = "\
usage: orca-relay client phone --cell URL --relay-host-id ID --invite TOKEN

A phone peer: connects to the host through the cell with an invite, sends each line of stdin
as a text frame and prints what the host answers. `client host` prints this command for you.

  --cell URL            the cell's WebSocket URL (default ws://127.0.0.1:8080)
  --relay-host-id ID    the host to reach
  --invite TOKEN        an invite the host created
";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Run,
    Migrate,
    CheckConfig,
    Budget(String),
    ClientHost(Vec<(String, String)>),
    ClientPhone(Vec<(String, String)>),
    Switch(crate::switch_tool::SwitchAction),
    FleetStatus(crate::fleet_status::FleetStatusOptions),
    Handover(crate::handover_command::HandoverOptions),
    /// `run --take-over …`: the next process of a live handover (started by `handover`).
    TakeOver(crate::roles::handover::TakeOver),
    Help,
    /// `--help` after a subcommand: that subcommand's help text.
    HelpFor(&'static str),
    Version,
}

/// The help text for the subcommand that `args` starts with, if it asks for help anywhere.
fn subcommand_help(args: &[String]) -> Option<&'static str> {
    let rest = args.get(1..).unwrap_or_default();
    if !rest.iter().any(|a| a == "--help" || a == "-h") {
        return None;
    }
    let second = args.get(1).map(String::as_str);
    Some(match args.first().map(String::as_str)? {
        "run" => RUN_HELP,
        "migrate" => MIGRATE_HELP,
        "check-config" => CHECK_CONFIG_HELP,
        "budget" => BUDGET_HELP,
        "switch" => SWITCH_HELP,
        "fleet" => FLEET_HELP,
        "handover" => HANDOVER_HELP,
        "client" => match second {
            Some("host") => CLIENT_HOST_HELP,
            Some("phone") => CLIENT_PHONE_HELP,
            _ => CLIENT_HELP,
        },
        _ => return None,
    })
}

/// Parses the arguments after the program name.
pub fn parse(args: &[String]) -> Result<Command, String> {
    if let Some(help) = subcommand_help(args) {
        return Ok(Command::HelpFor(help));
    }
    let first = args.first().map(String::as_str);
    match first {
        None => Ok(Command::Run),
        Some("run") if args.len() == 1 => Ok(Command::Run),
        Some("run") => parse_take_over(&args[1..]).map(Command::TakeOver),
        Some("handover") => {
            crate::handover_command::HandoverOptions::parse(&args[1..]).map(Command::Handover)
        }
        Some("migrate") if args.len() == 1 => Ok(Command::Migrate),
        Some("check-config") if args.len() == 1 => Ok(Command::CheckConfig),
        Some("budget") => match args.get(1) {
            Some(file) if args.len() == 2 => Ok(Command::Budget(file.clone())),
            _ => Err("usage: orca-relay budget FILE".into()),
        },
        Some("client") => {
            let flags = parse_flags(&args[2.min(args.len())..])?;
            match args.get(1).map(String::as_str) {
                Some("host") => Ok(Command::ClientHost(flags)),
                Some("phone") => Ok(Command::ClientPhone(flags)),
                _ => Err("usage: orca-relay client host|phone [options]".into()),
            }
        }
        Some("fleet") => {
            crate::fleet_status::FleetStatusOptions::parse(&args[1..]).map(Command::FleetStatus)
        }
        Some("switch") => {
            let flags = parse_flags(&args[2.min(args.len())..])?;
            crate::switch_tool::SwitchAction::parse(args.get(1).map(String::as_str), &flags)
                .map(Command::Switch)
        }
        Some("--help" | "-h" | "help") => Ok(Command::Help),
        Some("--version" | "-V") => Ok(Command::Version),
        Some(other) => Err(format!("unknown command {other:?}; see orca-relay --help")),
    }
}

/// `--take-over SOCKET --handover-fd FD [--test-fault FAULT] [--running JSON]`: how `handover`
/// starts the next process (not for operators). The token comes on descriptor FD, never on the
/// command line; `--running` says what the running process serves (no secret).
fn parse_take_over(args: &[String]) -> Result<crate::roles::handover::TakeOver, String> {
    let flags = parse_flags(args)?;
    let socket = flag(&flags, "take-over").ok_or("usage: orca-relay run")?;
    let line = flag(&flags, "handover-fd")
        .ok_or("--take-over needs --handover-fd")?
        .parse::<i32>()
        .ok()
        .filter(|fd| *fd > 2)
        .ok_or("--handover-fd needs a descriptor number above 2")?;
    let fault = match flag(&flags, "test-fault") {
        Some(name) => Some(
            crate::roles::handover::Fault::parse(name)
                .ok_or_else(|| format!("unknown --test-fault {name:?}"))?,
        ),
        None => None,
    };
    let running = flag(&flags, "running")
        .map(crate::handover::Running::from_arg)
        .transpose()?;
    if let Some((name, _)) = flags.iter().find(|(name, _)| {
        !matches!(
            name.as_str(),
            "take-over" | "handover-fd" | "test-fault" | "running"
        )
    }) {
        return Err(format!("unexpected argument --{name}"));
    }
    Ok(crate::roles::handover::TakeOver {
        socket: socket.into(),
        line,
        token: String::new(),
        fault,
        running,
    })
}

fn parse_flags(args: &[String]) -> Result<Vec<(String, String)>, String> {
    let mut flags = Vec::new();
    let mut iter = args.iter();
    while let Some(flag) = iter.next() {
        let Some(name) = flag.strip_prefix("--") else {
            return Err(format!("unexpected argument {flag:?}"));
        };
        let value = iter
            .next()
            .ok_or_else(|| format!("--{name} needs a value"))?;
        flags.push((name.to_string(), value.clone()));
    }
    Ok(flags)
}

fn flag<'a>(flags: &'a [(String, String)], name: &str) -> Option<&'a str> {
    flags
        .iter()
        .rev()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// Runs a command; returns the process exit code.
pub fn execute(command: Command) -> i32 {
    match command {
        Command::Help => {
            print!("{HELP}");
            0
        }
        Command::HelpFor(text) => {
            print!("{text}");
            0
        }
        Command::Version => {
            println!("orca-relay {}", env!("CARGO_PKG_VERSION"));
            0
        }
        Command::CheckConfig => {
            let lookup = |name: &str| std::env::var_os(name);
            let (code, out, err) = check_config(&lookup);
            print!("{out}");
            eprint!("{err}");
            code
        }
        // A configuration refused at start will be refused at every start: the units do not
        // restart the process for it (`RestartPreventExitStatus=`).
        Command::Run => with_config_refusing(EXIT_CONFIG, |config| {
            crate::roles::run(config).map_err(|e| e.to_string())
        }),
        Command::Handover(options) => crate::handover_command::run(&options),
        Command::TakeOver(mut take_over) => {
            if take_over.fault == Some(crate::roles::handover::Fault::ExitAtStart) {
                // A test's fault: a binary that exits at start.
                return 3;
            }
            // The token first: it comes once the command has made this process an orphan.
            match crate::roles::handover::read_token(take_over.line) {
                Ok(token) => take_over.token = token,
                Err(e) => {
                    eprintln!("orca-relay: {e}");
                    return 1;
                }
            }
            let config = match Config::from_env() {
                Ok(config) => config,
                Err(errors) => {
                    let problems: Vec<String> = errors.0.iter().map(|e| e.to_string()).collect();
                    let cause = format!(
                        "the new process refused its configuration: {}",
                        problems.join("; ")
                    );
                    crate::roles::handover::report_failed(
                        &take_over.socket,
                        &take_over.token,
                        &cause,
                    );
                    return 1;
                }
            };
            match crate::roles::take_over(config, take_over) {
                Ok(()) => 0,
                Err(e) => {
                    if crate::roles::handover::committed() {
                        eprintln!("orca-relay: {e}");
                    }
                    1
                }
            }
        }
        Command::Migrate => with_config(|config| {
            crate::roles::process::migrate(&config).map_err(|e| e.to_string())?;
            eprintln!("orca-relay: migrations applied");
            Ok(())
        }),
        Command::Budget(file) => match crate::budget::run_file(std::path::Path::new(&file)) {
            Ok(table) => {
                print!("{table}");
                0
            }
            Err(e) => {
                eprintln!("orca-relay budget: {e}");
                1
            }
        },
        Command::ClientHost(flags) => with_config(|config| {
            let options = host_options(&config, &flags)?;
            let stop = crate::client::stop_on_signals()?;
            crate::client::run_host(&options, &stop)
        }),
        Command::Switch(action) => {
            with_config(|config| crate::switch_tool::run(&config, &action, &mut std::io::stdout()))
        }
        Command::FleetStatus(options) => with_config(|config| {
            use std::io::IsTerminal;
            let stdout = std::io::stdout();
            let colour = crate::fleet_status::use_colour(
                stdout.is_terminal(),
                std::env::var("NO_COLOR").ok().as_deref(),
                std::env::var("TERM").ok().as_deref(),
            );
            crate::fleet_status::run(&config, &options, colour, &mut stdout.lock())
        }),
        Command::ClientPhone(flags) => {
            let options = PhoneOptions {
                cell_url: flag(&flags, "cell")
                    .unwrap_or("ws://127.0.0.1:8080")
                    .to_string(),
                relay_host_id: match flag(&flags, "relay-host-id") {
                    Some(id) => id.to_string(),
                    None => {
                        eprintln!("orca-relay client phone: --relay-host-id is required");
                        return 2;
                    }
                },
                invite: match flag(&flags, "invite") {
                    Some(invite) => invite.to_string(),
                    None => {
                        eprintln!("orca-relay client phone: --invite is required");
                        return 2;
                    }
                },
            };
            match crate::client::run_phone(&options) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("orca-relay client phone: {e}");
                    1
                }
            }
        }
    }
}

/// `check-config` over `lookup`: (exit code, stdout, stderr). Valid: every variable with its
/// effective value (secrets masked), then `config ok: role=… (N variables set)`. Not valid:
/// every problem, one line each, then `N problems` (a value that is not valid UTF-8 among
/// them, SPEC §13).
pub fn check_config(lookup: &dyn Fn(&str) -> Option<std::ffi::OsString>) -> (i32, String, String) {
    use std::fmt::Write as _;
    let (mut out, mut err) = (String::new(), String::new());
    match Config::from_os_lookup_all(lookup) {
        Ok(config) => {
            // The CA file is read as a start would read it, before anything is printed.
            let database_tls = match &config.database_tls {
                Some(tls) => match crate::store::tls::effective_setting(tls) {
                    Ok(line) => line,
                    Err(e) => {
                        let _ = writeln!(err, "orca-relay: {e}");
                        return (1, out, err);
                    }
                },
                None => "none (SQLite)".to_string(),
            };
            for (name, value) in config.describe() {
                let _ = writeln!(out, "{name}={value}");
            }
            let _ = writeln!(out, "effective database_tls: {database_tls}");
            if config.role != crate::config::Role::Director {
                // What this machine's limits allow, as a start would compute it (issue 12).
                let _ = crate::lifecycle::raise_fd_limit();
                match crate::capacity::read_limits() {
                    Ok(limits) => {
                        let needs = crate::roles::cell_runtime::capacity_needs(&config);
                        let plan = crate::capacity::plan(&limits, needs);
                        let _ = writeln!(out, "effective capacity: {}", plan.summary());
                        let _ = writeln!(out, "  {}", plan.descriptors_reserved);
                        for figure in &plan.capacity.figures {
                            let raise = figure.resource.how_to_raise();
                            let _ = writeln!(out, "  {figure} (raise: {raise})");
                        }
                        let _ = writeln!(
                            out,
                            "  {} (raise: {})",
                            plan.memory_figure(),
                            crate::capacity::Resource::Memory.how_to_raise()
                        );
                        let _ = writeln!(out, "  {}", plan.handover_figure());
                    }
                    Err(e) => {
                        let _ = writeln!(out, "effective capacity: unknown ({e})");
                    }
                }
            }
            let _ = writeln!(
                out,
                "config ok: role={} ({} variables set)",
                config.role.as_str(),
                Config::variables_set(&|name| Config::text_lookup(lookup, name))
            );
            (0, out, err)
        }
        Err(errors) => {
            for error in &errors.0 {
                let _ = writeln!(err, "orca-relay: {error}");
            }
            let _ = writeln!(err, "{}", errors.summary());
            (1, out, err)
        }
    }
}

/// `run`'s exit status for a configuration it refuses: `EX_CONFIG` of sysexits.h. A start that
/// fails for any other reason (a database, a director, a port) exits 1 and is restarted.
pub const EXIT_CONFIG: i32 = 78;

fn with_config(f: impl FnOnce(Config) -> Result<(), String>) -> i32 {
    with_config_refusing(1, f)
}

/// As [`with_config`], exiting `refused` for a configuration it refuses.
fn with_config_refusing(refused: i32, f: impl FnOnce(Config) -> Result<(), String>) -> i32 {
    let config = match Config::from_env() {
        Ok(config) => config,
        Err(errors) => {
            // One line per problem, each filed as an error under journald.
            for error in &errors.0 {
                crate::logging::print_fatal(&format!("orca-relay: {error}"));
            }
            return refused;
        }
    };
    match f(config) {
        Ok(()) => 0,
        Err(e) => {
            crate::logging::print_fatal(&format!("orca-relay: {e}"));
            1
        }
    }
}

fn host_options(config: &Config, flags: &[(String, String)]) -> Result<HostOptions, String> {
    let relay_host_id = match flag(flags, "relay-host-id") {
        Some(id) => id.to_string(),
        None => crate::client::random_host_id()?,
    };
    let user_id = flag(flags, "user-id").unwrap_or("local-user").to_string();
    let token = match flag(flags, "token") {
        Some(token) => token.to_string(),
        None => {
            let secret = match &config.self_hosted_key {
                Some(secret) => secret.clone(),
                None => {
                    let path = config.data_dir.join(crate::auth::SELF_HOSTED_KEY_FILE);
                    crate::auth::read_self_hosted_key(&path)
                        .map_err(|e| {
                            format!(
                                "no --token and cannot read the self-hosted key {}: {e} (start the combined role first)",
                                path.display()
                            )
                        })?
                }
            };
            crate::auth::mint_host_token(
                &secret,
                config.auth_issuer.as_deref(),
                &config.auth_audience,
                &user_id,
                &relay_host_id,
                3600,
                crate::clock::system().as_ref(),
            )
        }
    };
    Ok(HostOptions {
        director: flag(flags, "director")
            .map(str::to_string)
            .unwrap_or_else(|| format!("http://{}", config.http_addr)),
        relay_host_id,
        user_id,
        token,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parses_commands() {
        assert_eq!(parse(&args(&[])), Ok(Command::Run));
        assert_eq!(parse(&args(&["run"])), Ok(Command::Run));
        assert_eq!(parse(&args(&["migrate"])), Ok(Command::Migrate));
        assert_eq!(parse(&args(&["check-config"])), Ok(Command::CheckConfig));
        assert_eq!(
            parse(&args(&["budget", "f.json"])),
            Ok(Command::Budget("f.json".into()))
        );
        assert_eq!(parse(&args(&["--version"])), Ok(Command::Version));
        assert_eq!(
            parse(&args(&["client", "phone", "--invite", "x"])),
            Ok(Command::ClientPhone(vec![("invite".into(), "x".into())]))
        );
        assert!(parse(&args(&["budget"])).is_err());
        assert!(parse(&args(&["client", "phone", "--invite"])).is_err());
        assert!(parse(&args(&["frobnicate"])).is_err());
    }

    #[test]
    fn help_after_any_subcommand_is_that_subcommands_help() {
        assert_eq!(
            parse(&args(&["client", "phone", "--help"])),
            Ok(Command::HelpFor(CLIENT_PHONE_HELP))
        );
        assert_eq!(
            parse(&args(&["client", "phone", "--invite", "--help"])),
            Ok(Command::HelpFor(CLIENT_PHONE_HELP)),
            "not `--invite needs a value`"
        );
        assert_eq!(
            parse(&args(&["client", "host", "-h"])),
            Ok(Command::HelpFor(CLIENT_HOST_HELP))
        );
        assert_eq!(
            parse(&args(&["check-config", "--help"])),
            Ok(Command::HelpFor(CHECK_CONFIG_HELP))
        );
        assert_eq!(parse(&args(&["--help"])), Ok(Command::Help));
        assert!(parse(&args(&["frobnicate", "--help"])).is_err());
        assert_eq!(
            parse(&args(&["fleet", "status", "--help"])),
            Ok(Command::HelpFor(FLEET_HELP))
        );
        assert_eq!(
            parse(&args(&["fleet", "status", "--director", "--help"])),
            Ok(Command::HelpFor(FLEET_HELP))
        );
    }

    #[test]
    fn parses_fleet_status() {
        use crate::fleet_status::FleetStatusOptions;
        assert_eq!(
            parse(&args(&["fleet", "status", "--json"])),
            Ok(Command::FleetStatus(FleetStatusOptions {
                director: None,
                json: true
            }))
        );
        assert!(parse(&args(&["fleet"])).is_err());
        assert!(parse(&args(&["fleet", "status", "extra"])).is_err());
    }
}
