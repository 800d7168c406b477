//! The load in a process of its own: the test binary run again as `load_helper` (a test that
//! does nothing unless `ORCA_RELAY_LOAD_HELPER` names a job file), driven over its standard
//! input and answering on its standard output.
//!
//! Why: the stalls the tests measure must be the relay's, not the test process's. A test
//! process that starts commands (`orca-relay handover`, `systemctl`, `nsenter`), copies a
//! binary or reads `/proc` while its own threads stream would measure itself: a whole-process
//! pause shows as every stream stalling at once. The helper does nothing but the load.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;

use super::load::{Identity, Load, Report, Spec};

/// The environment variable naming the helper's job file.
pub const HELPER_ENV: &str = "ORCA_RELAY_LOAD_HELPER";

#[derive(serde::Serialize, serde::Deserialize)]
struct Job {
    ws: String,
    spec: Spec,
    identities: Vec<Identity>,
}

/// The load, running in a helper process.
pub struct RemoteLoad {
    child: Child,
    stdin: ChildStdin,
    answers: Receiver<String>,
    job: PathBuf,
}

impl RemoteLoad {
    /// Starts the helper (`test_name` is the calling binary's helper test) and waits until its
    /// sessions are set up.
    pub fn start(test_name: &str, ws: &str, spec: Spec, identities: Vec<Identity>) -> RemoteLoad {
        let job = std::env::temp_dir().join(format!(
            "orca-relay-load-{}-{}.json",
            std::process::id(),
            crate::harness::host_id()
        ));
        let body = serde_json::to_vec(&Job {
            ws: ws.to_string(),
            spec,
            identities,
        })
        .unwrap();
        std::fs::write(&job, body).expect("write the load's job");
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
            .env(HELPER_ENV, &job)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the load helper");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, answers) = mpsc::channel();
        orca_relay::threads::spawn("load-helper-out", move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest may have printed the test's name on the same line first.
                if let Some((_, answer)) = line.split_once("LOAD ") {
                    if tx.send(answer.to_string()).is_err() {
                        return;
                    }
                }
            }
        })
        .unwrap();
        let mut load = RemoteLoad {
            child,
            stdin,
            answers,
            job,
        };
        let ready = load.answer(Duration::from_secs(180));
        assert_eq!(ready, "ready", "the load helper did not set up");
        load
    }

    fn answer(&mut self, timeout: Duration) -> String {
        self.answers
            .recv_timeout(timeout)
            .unwrap_or_else(|e| panic!("no answer from the load helper: {e}"))
    }

    fn ask(&mut self, command: &str, timeout: Duration) -> String {
        writeln!(self.stdin, "{command}").expect("write to the load helper");
        self.stdin.flush().unwrap();
        self.answer(timeout)
    }

    pub fn mark(&mut self) {
        self.ask("mark", Duration::from_secs(30));
    }

    /// [`Load::probe`](super::load::Load::probe).
    pub fn probe(&mut self) {
        self.ask("probe", Duration::from_secs(30));
    }

    pub fn pause_desktop(&mut self, pair: usize) {
        self.ask(&format!("pause {pair}"), Duration::from_secs(30));
    }

    pub fn resume_desktop(&mut self, pair: usize) {
        self.ask(&format!("resume {pair}"), Duration::from_secs(30));
    }

    pub fn elapsed_ms(&mut self) -> u64 {
        self.ask("elapsed", Duration::from_secs(30))
            .parse()
            .unwrap()
    }

    pub fn report(&mut self) -> Report {
        serde_json::from_str(&self.ask("report", Duration::from_secs(30))).unwrap()
    }

    pub fn finish(mut self, timeout: Duration) -> Report {
        let report = self.ask(
            &format!("finish {}", timeout.as_millis()),
            timeout + Duration::from_secs(30),
        );
        serde_json::from_str(&report).unwrap()
    }
}

impl Drop for RemoteLoad {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.job);
    }
}

/// The helper's body: a no-op unless [`HELPER_ENV`] names a job. Call it from a test named
/// as the binary passes to [`RemoteLoad::start`].
pub fn helper_main() {
    let Some(job) = std::env::var_os(HELPER_ENV) else {
        return;
    };
    super::raise_fd_limit();
    let job: Job = serde_json::from_slice(&std::fs::read(job).expect("the job")).expect("a job");
    let load = Load::start(&job.ws, job.spec, job.identities);
    let say = |answer: &str| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "LOAD {answer}");
        let _ = out.flush();
    };
    say("ready");
    let mut load = Some(load);
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let mut words = line.split_whitespace();
        let Some(current) = load.as_ref() else {
            return;
        };
        match (words.next(), words.next()) {
            (Some("mark"), _) => {
                current.mark();
                say("ok");
            }
            (Some("probe"), _) => {
                current.probe();
                say("ok");
            }
            (Some("pause"), Some(pair)) => {
                current.pause_desktop(pair.parse().unwrap());
                say("ok");
            }
            (Some("resume"), Some(pair)) => {
                current.resume_desktop(pair.parse().unwrap());
                say("ok");
            }
            (Some("elapsed"), _) => say(&current.elapsed_ms().to_string()),
            (Some("report"), _) => say(&serde_json::to_string(&current.report()).unwrap()),
            (Some("finish"), Some(ms)) => {
                let report = load
                    .take()
                    .map(|load| load.finish(Duration::from_millis(ms.parse().unwrap())))
                    .unwrap_or_default();
                say(&serde_json::to_string(&report).unwrap());
                return;
            }
            _ => say("unknown"),
        }
    }
}
