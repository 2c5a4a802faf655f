//! The command line: what each command takes, parsed into a [`Command`].
//!
//! Hand-parsed, on purpose: six commands with a few options each, and the
//! usage text below is the whole help.  Options may stand anywhere after
//! the command.  Anything a command does not take (an unknown or misspelt
//! option, an option without its value, an operand too many) is refused
//! with a message: `run --confg x.toml` must not run with the default
//! configuration.

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
    Run {
        config: PathBuf,
    },
    CheckConfig {
        file: PathBuf,
    },
    Status {
        socket: ControlSocket,
        json: bool,
    },
    /// `image` is empty for all images.
    Reload {
        socket: ControlSocket,
        image: String,
    },
    CheckList {
        files: Vec<String>,
        json: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UsageError {
    CheckConfigNeedsFile,
    UnknownCommand(String),
    /// An option this command does not take (`command`, `option`).
    UnknownOption(&'static str, String),
    /// `--config` or `--socket` as the last argument.
    MissingValue(&'static str, String),
    /// An operand this command does not take (`command`, `operand`).
    UnexpectedOperand(&'static str, String),
}

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UsageError::CheckConfigNeedsFile => write!(f, "check-config needs a FILE"),
            UsageError::UnknownCommand(c) => write!(f, "unknown command {c:?}\n{USAGE}"),
            UsageError::UnknownOption(cmd, o) => {
                write!(f, "{cmd} does not take the option {o:?} (pageshare-server --help lists what it takes)")
            }
            UsageError::MissingValue(cmd, o) => write!(f, "{cmd}: {o} needs a value"),
            UsageError::UnexpectedOperand(cmd, a) => {
                write!(f, "{cmd} does not take {a:?} (pageshare-server --help lists what it takes)")
            }
        }
    }
}

impl std::error::Error for UsageError {}

/// What one command's arguments said.
#[derive(Default)]
struct Args {
    config: Option<PathBuf>,
    socket: Option<PathBuf>,
    json: bool,
    operands: Vec<String>,
}

/// Read `args` of command `cmd`, which takes the options in `takes` and at
/// most `max_operands` operands.
fn scan(
    cmd: &'static str,
    args: &[String],
    takes: &[&str],
    max_operands: usize,
) -> Result<Args, UsageError> {
    let mut out = Args::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a.starts_with('-') && a.len() > 1 {
            if !takes.contains(&a.as_str()) {
                return Err(UsageError::UnknownOption(cmd, a.clone()));
            }
            match a.as_str() {
                "--json" => out.json = true,
                "--config" | "--socket" => {
                    let v = it.next().ok_or_else(|| UsageError::MissingValue(cmd, a.clone()))?;
                    let slot = if a == "--config" { &mut out.config } else { &mut out.socket };
                    *slot = Some(v.into());
                }
                _ => unreachable!("every option in `takes` is handled"),
            }
        } else if out.operands.len() < max_operands {
            out.operands.push(a.clone());
        } else {
            return Err(UsageError::UnexpectedOperand(cmd, a.clone()));
        }
    }
    Ok(out)
}

impl Args {
    fn config(&self) -> PathBuf {
        self.config.clone().unwrap_or_else(|| DEFAULT_CONFIG.into())
    }

    /// `--socket` wins over `--config`.
    fn control_socket(&self) -> ControlSocket {
        match &self.socket {
            Some(s) => ControlSocket::Path(s.clone()),
            None => ControlSocket::FromConfig(self.config()),
        }
    }
}

/// Parse the arguments after the program name.
pub fn parse(args: &[String]) -> Result<Command, UsageError> {
    let Some(cmd) = args.first() else { return Ok(Command::Usage) };
    let rest = &args[1..];
    Ok(match cmd.as_str() {
        "-h" | "--help" | "help" => Command::Help,
        "--version" => Command::Version,
        "run" => Command::Run { config: scan("run", rest, &["--config"], 0)?.config() },
        "check-config" => {
            let a = scan("check-config", rest, &[], 1)?;
            Command::CheckConfig {
                file: a.operands.first().ok_or(UsageError::CheckConfigNeedsFile)?.into(),
            }
        }
        "status" => {
            let a = scan("status", rest, &["--config", "--socket", "--json"], 0)?;
            Command::Status { socket: a.control_socket(), json: a.json }
        }
        "reload" => {
            let a = scan("reload", rest, &["--config", "--socket"], 1)?;
            Command::Reload {
                socket: a.control_socket(),
                image: a.operands.first().cloned().unwrap_or_default(),
            }
        }
        "check-list" => {
            let a = scan("check-list", rest, &["--json"], usize::MAX)?;
            Command::CheckList { files: a.operands, json: a.json }
        }
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
        assert_eq!(
            p(&["run", "--config", "/x.toml"]),
            Ok(Command::Run { config: "/x.toml".into() })
        );
    }

    #[test]
    fn what_a_command_does_not_take_is_refused() {
        // A misspelt option must not run the daemon with the default config.
        assert_eq!(
            p(&["run", "--confg", "x.toml"]),
            Err(UsageError::UnknownOption("run", "--confg".into()))
        );
        assert_eq!(
            p(&["run", "--config"]),
            Err(UsageError::MissingValue("run", "--config".into()))
        );
        assert_eq!(
            p(&["run", "x.toml"]),
            Err(UsageError::UnexpectedOperand("run", "x.toml".into()))
        );
        assert_eq!(
            p(&["status", "--socket"]),
            Err(UsageError::MissingValue("status", "--socket".into()))
        );
        assert_eq!(p(&["status", "-j"]), Err(UsageError::UnknownOption("status", "-j".into())));
        assert_eq!(
            p(&["reload", "a", "b"]),
            Err(UsageError::UnexpectedOperand("reload", "b".into()))
        );
        assert_eq!(
            p(&["reload", "--json"]),
            Err(UsageError::UnknownOption("reload", "--json".into()))
        );
        assert_eq!(
            p(&["check-config", "a.toml", "b.toml"]),
            Err(UsageError::UnexpectedOperand("check-config", "b.toml".into()))
        );
        assert_eq!(
            p(&["check-list", "--all"]),
            Err(UsageError::UnknownOption("check-list", "--all".into()))
        );
        let text = p(&["run", "--confg", "x"]).unwrap_err().to_string();
        assert!(text.contains("run does not take the option \"--confg\""), "{text}");
        assert_eq!(p(&["run", "--config"]).unwrap_err().to_string(), "run: --config needs a value");
    }

    #[test]
    fn check_config_needs_a_file() {
        assert_eq!(
            p(&["check-config", "a.toml"]),
            Ok(Command::CheckConfig { file: "a.toml".into() })
        );
        let e = p(&["check-config"]).unwrap_err();
        assert_eq!(e, UsageError::CheckConfigNeedsFile);
        assert_eq!(e.to_string(), "check-config needs a FILE");
    }

    #[test]
    fn status_socket_wins_over_config() {
        assert_eq!(
            p(&["status"]),
            Ok(Command::Status { socket: from_config(DEFAULT_CONFIG), json: false })
        );
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
        assert_eq!(
            p(&["reload"]),
            Ok(Command::Reload { socket: from_config(DEFAULT_CONFIG), image: String::new() })
        );
        assert_eq!(
            p(&["reload", "--socket", "/run/s", "debian"]),
            Ok(Command::Reload {
                socket: ControlSocket::Path("/run/s".into()),
                image: "debian".into()
            })
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
        assert!(
            text.starts_with("unknown command \"serve\"\nusage: pageshare-server COMMAND"),
            "{text}"
        );
    }

    #[test]
    fn usage_names_every_command() {
        for c in
            ["run", "status", "reload", "check-config", "check-list", "--version", DEFAULT_CONFIG]
        {
            assert!(USAGE.contains(c), "{c}");
        }
    }
}
