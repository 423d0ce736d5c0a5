//! Test certificates: a CA made with rcgen that signs leaf certificates into a directory.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

use super::write_file;

/// A CA that writes certificates it signed into a directory.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// PEM of the CA certificate.
    pub pem: PathBuf,
    dir: PathBuf,
    name: String,
}

impl Ca {
    /// Generates a CA named after `name` and writes its certificate to
    /// `dir/NAME-ca.pem`; the leaves it signs go to `dir` too.
    pub fn new(dir: &Path, name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, format!("usher test CA {name}"));
        let cert = params.self_signed(&key).unwrap();
        let pem = write_file(dir, &format!("{name}-ca.pem"), &cert.pem());
        Ca { issuer: Issuer::new(params, key), pem, dir: dir.to_path_buf(), name: name.into() }
    }

    /// A leaf certificate for `sans` (DNS names or IP addresses): (cert file, key file).
    pub fn leaf(&self, file: &str, sans: &[&str]) -> (PathBuf, PathBuf) {
        self.make_leaf(file, sans, true)
    }

    /// As [`Ca::leaf`], with an empty subject (no CommonName): etcd's JSON
    /// gateway refuses client certificates with a CommonName once auth is on.
    pub fn leaf_without_cn(&self, file: &str, sans: &[&str]) -> (PathBuf, PathBuf) {
        self.make_leaf(file, sans, false)
    }

    fn make_leaf(&self, file: &str, sans: &[&str], cn: bool) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        if cn {
            params.distinguished_name.push(DnType::CommonName, format!("{file} ({})", self.name));
        }
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (
            write_file(&self.dir, &format!("{file}.pem"), &cert.pem()),
            write_file(&self.dir, &format!("{file}.key"), &key.serialize_pem()),
        )
    }
}
