//! A throwaway PKI made with the `openssl` CLI, for TLS between real components (etcd and its
//! clients) in tests.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};

/// Runs the `openssl` CLI (`scripts/ensure-deps --for-tests` installs it), failing with its
/// stderr.
fn openssl(command: &mut Command) -> anyhow::Result<()> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .context("cannot run openssl: run scripts/test (it installs openssl)")?;
    if !output.status.success() {
        bail!(
            "openssl failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// A throwaway PKI made with the `openssl` CLI, as the `--tls-cert` test makes its certificate:
/// a CA, a server certificate for 127.0.0.1 (IP SAN) and a client certificate, both signed by
/// the CA. EC P-256 keys (PKCS#8 PEM), valid for a day, in a temporary directory.
pub struct TestPki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    dir: tempfile::TempDir,
}

impl TestPki {
    pub fn generate() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let path = |name: &str| dir.path().join(name);
        let new_key = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        openssl(
            Command::new("openssl")
                .args(["req", "-x509", "-days", "1"])
                .args(new_key)
                .args(["-subj", "/CN=switchyard test CA"])
                .args(["-addext", "basicConstraints=critical,CA:TRUE"])
                .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign"])
                .arg("-keyout")
                .arg(path("ca.key"))
                .arg("-out")
                .arg(path("ca.pem")),
        )?;
        let pki = Self {
            ca: path("ca.pem"),
            server_cert: path("server.pem"),
            server_key: path("server.key"),
            client_cert: path("client.pem"),
            client_key: path("client.key"),
            dir,
        };
        // etcd 3.4's gateway dials its own gRPC port with the server certificate, so that one
        // is a client too.
        pki.sign(
            "server",
            "/CN=etcd",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth",
        )?;
        pki.sign(
            "client",
            "/CN=switchyard-control",
            "extendedKeyUsage=clientAuth",
        )?;
        Ok(pki)
    }

    /// Makes `{name}.key` and `{name}.pem`, signed by the CA, with the given v3 extensions.
    fn sign(&self, name: &str, subject: &str, extensions: &str) -> anyhow::Result<()> {
        let path = |file: String| self.dir.path().join(file);
        let extensions_file = path(format!("{name}.ext"));
        std::fs::write(
            &extensions_file,
            format!(
                "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n{extensions}\n"
            ),
        )?;
        openssl(
            Command::new("openssl")
                .args(["req", "-new", "-newkey", "ec"])
                .args(["-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"])
                .args(["-subj", subject])
                .arg("-keyout")
                .arg(path(format!("{name}.key")))
                .arg("-out")
                .arg(path(format!("{name}.csr"))),
        )?;
        openssl(
            Command::new("openssl")
                .args(["x509", "-req", "-days", "1", "-CAcreateserial"])
                .arg("-in")
                .arg(path(format!("{name}.csr")))
                .arg("-CA")
                .arg(&self.ca)
                .arg("-CAkey")
                .arg(path("ca.key".into()))
                .arg("-extfile")
                .arg(&extensions_file)
                .arg("-out")
                .arg(path(format!("{name}.pem"))),
        )
    }

    /// A gRPC client TLS configuration trusting this CA and presenting the client certificate.
    pub fn client_tls(&self) -> anyhow::Result<tonic::transport::ClientTlsConfig> {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        Ok(ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(std::fs::read(&self.ca)?))
            .identity(Identity::from_pem(
                std::fs::read(&self.client_cert)?,
                std::fs::read(&self.client_key)?,
            )))
    }
}
