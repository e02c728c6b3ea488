//! A TCP relay that can be frozen: a network partition between two real components.

use std::net::SocketAddr;

use switchyard_testkit::loopback_any;

/// A TCP relay on loopback in front of `target` that can be frozen: while frozen, bytes stop
/// flowing both ways on every connection (connections stay open, new ones are accepted but not
/// connected through), as in a network partition. For faults between two real components
/// (a control plane and its etcd) that cannot be had by stopping either of them.
pub struct Relay {
    pub addr: SocketAddr,
    frozen: tokio::sync::watch::Sender<bool>,
    _task: tokio_util::task::AbortOnDropHandle<()>,
}

impl Relay {
    pub async fn start(target: SocketAddr) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(loopback_any()).await?;
        let addr = listener.local_addr()?;
        let (frozen, _) = tokio::sync::watch::channel(false);
        let watch = frozen.clone();
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                let frozen = watch.subscribe();
                connections.spawn(async move {
                    let _ = relay_connection(inbound, target, frozen).await;
                });
            }
        });
        Ok(Self {
            addr,
            frozen,
            _task: tokio_util::task::AbortOnDropHandle::new(task),
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    pub fn thaw(&self) {
        self.frozen.send_replace(false);
    }
}

async fn relay_connection(
    inbound: tokio::net::TcpStream,
    target: SocketAddr,
    frozen: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut gate = frozen.clone();
    let _ = gate.wait_for(|frozen| !*frozen).await;
    let outbound = tokio::net::TcpStream::connect(target).await?;
    inbound.set_nodelay(true)?;
    outbound.set_nodelay(true)?;
    let (inbound_read, inbound_write) = inbound.into_split();
    let (outbound_read, outbound_write) = outbound.into_split();
    tokio::select! {
        result = pump(inbound_read, outbound_write, frozen.clone()) => result,
        result = pump(outbound_read, inbound_write, frozen) => result,
    }
}

/// Copies `from` to `to`, holding every chunk while the relay is frozen.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let read = from.read(&mut buffer).await?;
        if read == 0 {
            return Ok(());
        }
        if frozen.wait_for(|frozen| !*frozen).await.is_err() {
            return Ok(());
        }
        to.write_all(&buffer[..read]).await?;
    }
}
