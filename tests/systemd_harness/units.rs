//! The units of the private manager besides the ones under test: stub targets (so that nothing
//! of the host's boot is pulled in) and the distribution's own journald and exit units.

/// The target the manager boots into (`--unit=`).
pub const DEFAULT_TARGET: &str = "orca-relay-test.target";

/// Targets that exist only so that units naming them find them: with no dependencies of their
/// own, they start nothing of the host's.
const EMPTY_TARGETS: &[&str] = &[
    "local-fs.target",
    "swap.target",
    "paths.target",
    "timers.target",
    "slices.target",
    "sockets.target",
    "network.target",
    "network-online.target",
];

/// Copied from the machine's systemd (`/lib/systemd/system`): the journal (the tests read the
/// units' logs through it) and what `systemctl exit` needs.
pub const FROM_SYSTEMD: &[&str] = &[
    "systemd-journald.service",
    "systemd-journald.socket",
    "systemd-journald-dev-log.socket",
    "exit.target",
    "systemd-exit.service",
    "shutdown.target",
    "final.target",
    "umount.target",
];

/// (file name, contents) of every stub unit.
pub fn stubs() -> Vec<(String, String)> {
    let mut units: Vec<(String, String)> = EMPTY_TARGETS
        .iter()
        .map(|name| {
            (
                name.to_string(),
                format!("[Unit]\nDescription=stub {name}\nDefaultDependencies=no\n"),
            )
        })
        .collect();
    units.push((
        "sysinit.target".into(),
        "[Unit]\nDescription=stub sysinit.target (the journal only)\nDefaultDependencies=no\n\
         Wants=systemd-journald.socket systemd-journald-dev-log.socket systemd-journald.service\n\
         After=systemd-journald.socket systemd-journald-dev-log.socket\n"
            .into(),
    ));
    units.push((
        "basic.target".into(),
        "[Unit]\nDescription=stub basic.target\nDefaultDependencies=no\nRequires=sysinit.target\n\
         After=sysinit.target sockets.target paths.target slices.target\n"
            .into(),
    ));
    units.push((
        "multi-user.target".into(),
        "[Unit]\nDescription=multi-user.target\nRequires=basic.target\nAfter=basic.target\n\
         AllowIsolate=yes\n"
            .into(),
    ));
    units.push((
        DEFAULT_TARGET.into(),
        "[Unit]\nDescription=orca-relay systemd tests\nRequires=multi-user.target\n\
         After=multi-user.target\nAllowIsolate=yes\n"
            .into(),
    ));
    units
}
