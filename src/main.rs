//! `orca-relay`: parse the arguments, set up logging, hand off to `cli`.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let command = match orca_relay::cli::parse(&args) {
        Ok(command) => command,
        Err(message) => {
            eprintln!("orca-relay: {message}");
            std::process::exit(2);
        }
    };
    orca_relay::logging::init();
    std::process::exit(orca_relay::cli::execute(command));
}
