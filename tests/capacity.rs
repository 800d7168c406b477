//! `capacity` on this machine: the maps a relay thread costs, measured, and the reader.

use std::sync::mpsc;

use orca_relay::capacity::{self, Reserve, MAPS_PER_THREAD};
use orca_relay::threads::{spawn_with_stack, RELAY_STACK_BYTES};

fn maps_now() -> u64 {
    capacity::read_limits().expect("read limits").maps_in_use
}

/// Spawns parked threads with the relay's stack size and counts the maps they add: the cost
/// `MAPS_PER_THREAD` stands for (glibc stack + guard, std's signal stack + guard). Other tests
/// in this binary may start a thread meanwhile, so the per-thread figure is rounded over many.
#[test]
fn a_relay_thread_costs_maps_per_thread() {
    const THREADS: u64 = 200;
    let before = maps_now();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let release_rx = std::sync::Arc::new(std::sync::Mutex::new(release_rx));
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let mut handles = Vec::new();
    for i in 0..THREADS {
        let ready = ready_tx.clone();
        let release = release_rx.clone();
        handles.push(
            spawn_with_stack(format!("maps-{i}"), RELAY_STACK_BYTES, move || {
                ready.send(()).unwrap();
                // Parks until the sender is dropped.
                let _ = release.lock().unwrap().recv();
            })
            .expect("spawn"),
        );
    }
    for _ in 0..THREADS {
        ready_rx.recv().unwrap();
    }
    let during = maps_now();
    drop(release_tx);
    for handle in handles {
        handle.join().unwrap();
    }
    let per_thread = (during - before) as f64 / THREADS as f64;
    eprintln!("maps: {before} before, {during} with {THREADS} threads: {per_thread:.2} per thread");
    assert_eq!(per_thread.round() as u64, MAPS_PER_THREAD, "{per_thread}");
}

/// The reader on this machine: every figure is read, and the capacity is positive and below
/// each limit.
#[test]
fn the_reader_fills_every_limit_on_this_machine() {
    // As a role does at start.
    let _ = orca_relay::lifecycle::raise_fd_limit();
    let limits = capacity::read_limits().expect("read limits");
    assert!(limits
        .descriptors
        .is_some_and(|n| n > limits.descriptors_in_use));
    assert!(limits.max_map_count.is_some_and(|n| n > limits.maps_in_use));
    assert!(limits
        .threads_max
        .is_some_and(|n| n > limits.tasks_on_machine));
    assert!(limits.pid_max.is_some_and(|n| n > limits.tasks_on_machine));
    assert!(limits.process_threads >= 1 && limits.maps_in_use > 10);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    let reserve = Reserve::for_relay(cpus, 10, RELAY_STACK_BYTES as u64);
    let capacity = capacity::compute(&limits, reserve, MAPS_PER_THREAD);
    eprintln!("{limits:?}");
    eprintln!("{}", capacity.summary());
    for figure in &capacity.figures {
        eprintln!("  {figure}");
    }
    assert!(capacity.connections > 0);
    assert!(capacity.connections <= capacity.descriptors);
    assert!(capacity.connections <= capacity.threaded);
    let descriptors = limits.descriptors.unwrap();
    assert!(capacity.descriptors < descriptors);
}
