//! `nuwa-node`: the nuwa-sync daemon and its command-line client.
//!
//! This crate is the only one that knows about processes, the CLI, the home
//! directory's files and the local HTTP API. The protocol logic lives in the
//! library crates; see ARCHITECTURE.md.

mod api;
mod client;
mod daemon;
mod home;
mod status;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use nuwa_net::Multiaddr;

const ABOUT: &str = "nuwa-node keeps one AI agent's state identical across all of its devices: \
private (end-to-end encrypted), offline-first, peer to peer.";

const AFTER_HELP: &str = "\
Quick start (three devices of one agent on this machine):
  nuwa-node --home /tmp/a init --name laptop
  nuwa-node --home /tmp/a device provision --out /tmp/b --name phone
  nuwa-node --home /tmp/a run &      # likewise for /tmp/b
  nuwa-node --home /tmp/a state put notes today '\"buy milk\"'
  nuwa-node --home /tmp/b state get notes --json

Logs go to stderr; set RUST_LOG (e.g. RUST_LOG=debug) for more detail.";

#[derive(Parser, Debug)]
#[command(name = "nuwa-node", version, about = ABOUT, after_help = AFTER_HELP)]
struct Cli {
    /// Home directory holding this device's keys, the agent's DID log and the
    /// encrypted store. Default: the platform's data directory.
    #[arg(long, global = true, env = "NUWA_HOME", value_name = "DIR")]
    home: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create a new agent (DID document, master key, sync key) with this
    /// device as its first device.
    Init {
        /// A name for this device, shown in status.
        #[arg(long, default_value = "")]
        name: String,
    },
    /// Manage the agent's devices.
    Device {
        #[command(subcommand)]
        command: DeviceCommand,
    },
    /// Run the daemon in the foreground until SIGINT or SIGTERM.
    Run {
        /// Address to listen on for peers (repeatable).
        #[arg(long, value_name = "MULTIADDR", default_value = "/ip4/0.0.0.0/tcp/0")]
        listen: Vec<Multiaddr>,
        /// Peer address to dial at start, e.g. /ip4/10.0.0.2/tcp/4001/p2p/12D3... (repeatable).
        #[arg(long = "peer", value_name = "MULTIADDR")]
        peers: Vec<Multiaddr>,
        /// Do not discover or announce on the LAN via mDNS.
        #[arg(long)]
        no_mdns: bool,
        /// Network interface for mDNS (repeatable), e.g. `lo` for tests on
        /// one machine. Default: every non-loopback interface.
        #[arg(long = "mdns-interface", value_name = "NAME")]
        mdns_interfaces: Vec<String>,
        /// Address of the local API (loopback only).
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
        api_listen: SocketAddr,
    },
    /// Show this device, the agent DID, verified peers, rejections and
    /// containers (asks the running daemon).
    Status {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Read and write state through the running daemon.
    State {
        #[command(subcommand)]
        command: StateCommand,
    },
}

#[derive(Subcommand, Debug)]
enum DeviceCommand {
    /// Create another device of this agent offline (for testnets and CI): a
    /// home directory holding its key, the updated DID document and the sync
    /// key. Run it in the home where `init` ran.
    Provision {
        /// New home directory to create for the device.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// A name for the new device.
        #[arg(long, default_value = "")]
        name: String,
    },
}

#[derive(Subcommand, Debug)]
enum StateCommand {
    /// Set KEY in the map container CONTAINER (created on first use) to the
    /// JSON value. Returns once the write is durable on this device.
    Put {
        container: String,
        key: String,
        /// A JSON value, e.g. '"text"', '42' or '{"a":[1,2]}'.
        json: String,
    },
    /// Print a container (or one KEY of it) as JSON.
    Get {
        container: String,
        key: Option<String>,
        /// Print compact JSON on one line (stable key order).
        #[arg(long)]
        json: bool,
    },
    /// Write the container's Automerge document in the standard binary
    /// format to FILE (plaintext: choose where it goes with care).
    Export {
        container: String,
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match real_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main(cli: Cli) -> Result<()> {
    let home_dir = match cli.home {
        Some(h) => h,
        None => home::default_home()?,
    };
    match cli.command {
        Command::Init { name } => {
            let h = home::init(&home_dir, &name)?;
            println!("agent did:   {}", h.log.did());
            println!("context id:  {}", h.info.context_id);
            println!("home:        {}", home_dir.display());
            println!("next: nuwa-node --home {} run", home_dir.display());
            Ok(())
        }
        Command::Device {
            command: DeviceCommand::Provision { out, name },
        } => {
            let info = home::provision(&home_dir, &out, &name)?;
            println!(
                "provisioned device {} in {}",
                info.context_id,
                out.display()
            );
            println!("next: nuwa-node --home {} run", out.display());
            Ok(())
        }
        Command::Run {
            listen,
            peers,
            no_mdns,
            mdns_interfaces,
            api_listen,
        } => {
            init_tracing();
            if !api_listen.ip().is_loopback() {
                anyhow::bail!("--api-listen must be a loopback address (got {api_listen})");
            }
            let h = home::load(&home_dir)?;
            let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
            rt.block_on(daemon::run(
                h,
                daemon::RunOptions {
                    listen,
                    peers,
                    mdns: !no_mdns,
                    mdns_interfaces,
                    api_listen,
                },
            ))
        }
        Command::Status { json } => client::status(&home_dir, json),
        Command::State { command } => match command {
            StateCommand::Put {
                container,
                key,
                json,
            } => client::put(&home_dir, &container, &key, &json),
            StateCommand::Get {
                container,
                key,
                json,
            } => client::get(&home_dir, &container, key.as_deref(), json),
            StateCommand::Export { container, out } => client::export(&home_dir, &container, &out),
        },
    }
}
