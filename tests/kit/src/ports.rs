//! Loopback addresses for tests that run in parallel: any free port, a port held to refuse
//! connections, and whether this process listens on an address.

use std::net::{SocketAddr, TcpListener};

use anyhow::Context as _;

/// `127.0.0.1:0`: bind it and ask the socket which port it got.
pub fn loopback_any() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A loopback port nobody listens on right now, for etcd, which must be told its ports up
/// front. Bound then released, so another process may take it before etcd does: `Etcd`
/// retries its start on a conflict. Everything else binds `127.0.0.1:0` itself.
pub(crate) fn unused_port() -> u16 {
    TcpListener::bind(loopback_any())
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free loopback port")
}

/// A loopback address that refuses connections for as long as this value lives: the port is
/// bound (so no parallel test can take it) but never listens, so a connection attempt gets a
/// reset at once. For "connection refused" checks, which a released port cannot give reliably.
pub struct RefusingPort {
    pub addr: SocketAddr,
    socket: Option<tokio::net::TcpSocket>,
}

impl RefusingPort {
    pub fn new() -> anyhow::Result<Self> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(loopback_any())?;
        let addr = socket.local_addr()?;
        Ok(Self {
            addr,
            socket: Some(socket),
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Starts listening on the held port (a service coming back on the address it had).
    pub fn listen(mut self) -> anyhow::Result<tokio::net::TcpListener> {
        let socket = self.socket.take().context("already listening")?;
        Ok(socket.listen(128)?)
    }
}

/// Whether this process has a socket listening on `addr` (IPv4). Read from /proc (the
/// listening sockets of the network namespace, matched to this process's file descriptors),
/// so "our listener closed" does not depend on the port staying free: a connection attempt
/// would succeed if a parallel test bound the port after we released it.
pub fn listens_in_this_process(addr: SocketAddr) -> bool {
    let std::net::IpAddr::V4(ip) = addr.ip() else {
        return false;
    };
    // /proc/net/tcp writes the address as the little-endian u32 in hex, then the port.
    let local = format!(
        "{:08X}:{:04X}",
        u32::from_le_bytes(ip.octets()),
        addr.port()
    );
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let listening: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address, state 0A = LISTEN, inode
            (fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&"0A"))
                .then(|| fields.get(9).map(|inode| format!("socket:[{inode}]")))
                .flatten()
        })
        .collect();
    if listening.is_empty() {
        return false;
    }
    std::fs::read_dir("/proc/self/fd")
        .map(|fds| {
            fds.filter_map(Result::ok).any(|fd| {
                std::fs::read_link(fd.path()).is_ok_and(|target| {
                    listening
                        .iter()
                        .any(|socket| target.as_os_str() == socket.as_str())
                })
            })
        })
        .unwrap_or(false)
}
