//! `orca-relay`: parse the arguments, set up logging, hand off to `cli`. A refusal is printed
//! with `logging::print_fatal` (priority 3 under journald).

fn main() {
    orca_relay::relay::buffer_budget::large_buffers_from_the_kernel();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let command = match orca_relay::cli::parse(&args) {
        Ok(command) => command,
        Err(message) => {
            orca_relay::logging::print_fatal(&format!("orca-relay: {message}"));
            std::process::exit(2);
        }
    };
    orca_relay::logging::init();
    std::process::exit(orca_relay::cli::execute(command));
}
