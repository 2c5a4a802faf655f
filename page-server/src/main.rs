//! pageshare-server: per-host daemon that preloads the verified blocks of
//! golden images into mergeable memory and publishes block -> address tables
//! to QEMU.  See page-server/README.md and page-server/PROTOCOL.md.

mod arena;
mod blockreader;
mod cli;
mod commands;
mod config;
mod feedback;
mod identity;
mod loader;
mod log;
mod metrics;
mod notify;
mod proto;
mod redis_feedback;
mod redis_watch;
mod sectorlist;
mod server;
mod sys;
mod table;

#[cfg(test)]
mod fuzz_tests;
#[cfg(test)]
mod test_dir;

use cli::Command;
use std::fmt;

/// Everything that makes the program exit with status 2.
#[derive(Debug)]
enum Error {
    Usage(cli::UsageError),
    Config(config::ConfigError),
    Server(server::ServerError),
    Command(commands::CommandError),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Usage(e) => e.fmt(f),
            Error::Config(e) => e.fmt(f),
            Error::Server(e) => e.fmt(f),
            Error::Command(e) => e.fmt(f),
        }
    }
}

fn real_main() -> Result<i32, Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match cli::parse(&args).map_err(Error::Usage)? {
        Command::Usage => {
            eprint!("{}", cli::USAGE);
            Ok(2)
        }
        Command::Help => {
            print!("{}", cli::USAGE);
            Ok(0)
        }
        Command::Version => {
            println!("pageshare-server {}", env!("CARGO_PKG_VERSION"));
            Ok(0)
        }
        Command::Run { config } => {
            let c = config::Config::load(&config).map_err(Error::Config)?;
            server::Server::new(c).and_then(server::Server::run).map_err(Error::Server)?;
            Ok(0)
        }
        Command::CheckConfig { file } => commands::check_config(&file).map_err(Error::Config),
        Command::Status { socket, json } => commands::status(&socket, json).map_err(Error::Command),
        Command::Reload { socket, image } => {
            commands::reload(&socket, &image).map_err(Error::Command)
        }
        Command::CheckList { files, json } => Ok(commands::check_list(&files, json)),
    }
}

fn main() {
    match real_main() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("pageshare-server: error: {e}");
            std::process::exit(2);
        }
    }
}
