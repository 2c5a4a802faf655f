//! The command line: what each command takes, parsed into a [`Command`].
//!
//! Hand-parsed, on purpose: six commands with a few options each, and the
//! usage text below is the whole help.  Options may stand anywhere after
//! the command; options a command does not take are ignored.

use std::fmt;
use std::path::PathBuf;

pub const DEFAULT_CONFIG: &str = "/etc/pageshare/server.toml";

pub const USAGE: &str = "\
usage: pageshare-server COMMAND [ARGS]

commands:
  run --config FILE            run the daemon (systemd: Type=notify)
  status [--config FILE | --socket PATH] [--json]
                               ask a running daemon for its state and stats
  reload [IMAGE] [--config FILE | --socket PATH]
                               re-read the lists (all images, or one)
  check-config FILE            parse and validate a configuration file
  check-list [--json] FILE...  validate pcsl v1 lists exactly as the daemon does
  --version

The default config is /etc/pageshare/server.toml.
";

/// Where a client command finds the daemon's control socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlSocket {
    /// `--socket PATH`.
    Path(PathBuf),
    /// The `control_socket` of this configuration file (`--config`, or the
    /// default).
    FromConfig(PathBuf),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// No command at all: the usage on stderr, exit status 2.
    Usage,
    /// `-h`, `--help`, `help`: the usage on stdout.
    Help,
    Version,
    Run { config: PathBuf },
    CheckConfig { file: PathBuf },
    Status { socket: ControlSocket, json: bool },
    /// `image` is empty for all images.
    Reload { socket: ControlSocket, image: String },
    CheckList { files: Vec<String>, json: bool },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UsageError {
    CheckConfigNeedsFile,
    UnknownCommand(String),
}

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UsageError::CheckConfigNeedsFile => write!(f, "check-config needs a FILE"),
            UsageError::UnknownCommand(c) => write!(f, "unknown command {c:?}\n{USAGE}"),
        }
    }
}

impl std::error::Error for UsageError {}

/// The value after the first `name` in `args`, if there is one.
fn option_value(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn has_flag(args: &[String], name: &str) -> bool {
    args.iter().any(|a| a == name)
}

fn config_path(args: &[String]) -> PathBuf {
    option_value(args, "--config").unwrap_or_else(|| DEFAULT_CONFIG.into()).into()
}

/// `--socket` wins over `--config`.
fn control_socket(args: &[String]) -> ControlSocket {
    match option_value(args, "--socket") {
        Some(s) => ControlSocket::Path(s.into()),
        None => ControlSocket::FromConfig(config_path(args)),
    }
}

/// The first argument that is neither an option nor an option's value.
fn first_operand(args: &[String]) -> Option<String> {
    args.iter()
        .enumerate()
        .find(|(i, a)| !a.starts_with("--") && (*i == 0 || !["--socket", "--config"].contains(&args[i - 1].as_str())))
        .map(|(_, a)| a.clone())
}

/// Parse the arguments after the program name.
pub fn parse(args: &[String]) -> Result<Command, UsageError> {
    let Some(cmd) = args.first() else { return Ok(Command::Usage) };
    let rest = &args[1..];
    Ok(match cmd.as_str() {
        "-h" | "--help" | "help" => Command::Help,
        "--version" => Command::Version,
        "run" => Command::Run { config: config_path(rest) },
        "check-config" => Command::CheckConfig { file: rest.first().ok_or(UsageError::CheckConfigNeedsFile)?.into() },
        "status" => Command::Status { socket: control_socket(rest), json: has_flag(rest, "--json") },
        "reload" => Command::Reload { socket: control_socket(rest), image: first_operand(rest).unwrap_or_default() },
        "check-list" => Command::CheckList {
            files: rest.iter().filter(|a| *a != "--json").cloned().collect(),
            json: has_flag(rest, "--json"),
        },
        other => return Err(UsageError::UnknownCommand(other.to_string())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Command, UsageError> {
        parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    fn from_config(path: &str) -> ControlSocket {
        ControlSocket::FromConfig(path.into())
    }

    #[test]
    fn no_command_help_and_version() {
        assert_eq!(p(&[]), Ok(Command::Usage));
        for h in ["-h", "--help", "help"] {
            assert_eq!(p(&[h]), Ok(Command::Help));
        }
        assert_eq!(p(&["--version"]), Ok(Command::Version));
    }

    #[test]
    fn run_takes_a_config_or_the_default() {
        assert_eq!(p(&["run"]), Ok(Command::Run { config: DEFAULT_CONFIG.into() }));
        assert_eq!(p(&["run", "--config", "/x.toml"]), Ok(Command::Run { config: "/x.toml".into() }));
        // --config without its value: the default.
        assert_eq!(p(&["run", "--config"]), Ok(Command::Run { config: DEFAULT_CONFIG.into() }));
    }

    #[test]
    fn check_config_needs_a_file() {
        assert_eq!(p(&["check-config", "a.toml"]), Ok(Command::CheckConfig { file: "a.toml".into() }));
        let e = p(&["check-config"]).unwrap_err();
        assert_eq!(e, UsageError::CheckConfigNeedsFile);
        assert_eq!(e.to_string(), "check-config needs a FILE");
    }

    #[test]
    fn status_socket_wins_over_config() {
        assert_eq!(p(&["status"]), Ok(Command::Status { socket: from_config(DEFAULT_CONFIG), json: false }));
        assert_eq!(
            p(&["status", "--json", "--config", "c.toml"]),
            Ok(Command::Status { socket: from_config("c.toml"), json: true })
        );
        assert_eq!(
            p(&["status", "--config", "c.toml", "--socket", "/run/s"]),
            Ok(Command::Status { socket: ControlSocket::Path("/run/s".into()), json: false })
        );
    }

    #[test]
    fn reload_image_is_the_first_operand_not_an_option_value() {
        assert_eq!(p(&["reload"]), Ok(Command::Reload { socket: from_config(DEFAULT_CONFIG), image: String::new() }));
        assert_eq!(
            p(&["reload", "--socket", "/run/s", "debian"]),
            Ok(Command::Reload { socket: ControlSocket::Path("/run/s".into()), image: "debian".into() })
        );
        assert_eq!(
            p(&["reload", "fedora", "--config", "c.toml"]),
            Ok(Command::Reload { socket: from_config("c.toml"), image: "fedora".into() })
        );
    }

    #[test]
    fn check_list_takes_every_other_argument_as_a_file() {
        assert_eq!(
            p(&["check-list", "a.pcsl", "--json", "b.pcsl"]),
            Ok(Command::CheckList { files: vec!["a.pcsl".into(), "b.pcsl".into()], json: true })
        );
        assert_eq!(p(&["check-list"]), Ok(Command::CheckList { files: vec![], json: false }));
    }

    #[test]
    fn unknown_command_shows_the_usage() {
        let e = p(&["serve"]).unwrap_err();
        assert_eq!(e, UsageError::UnknownCommand("serve".into()));
        let text = e.to_string();
        assert!(text.starts_with("unknown command \"serve\"\nusage: pageshare-server COMMAND"), "{text}");
    }

    #[test]
    fn usage_names_every_command() {
        for c in ["run", "status", "reload", "check-config", "check-list", "--version", DEFAULT_CONFIG] {
            assert!(USAGE.contains(c), "{c}");
        }
    }
}
