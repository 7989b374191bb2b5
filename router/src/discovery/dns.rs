//! Kubernetes discovery through DNS: a headless Service's name resolves to one address per
//! ready pod, so re-resolving it every refresh interval follows the group as pods come, go and
//! turn (un)ready. A name with a port (`tandem-decode.ns.svc:50100`) is looked up as A/AAAA
//! records and every address takes that port; a name without one
//! (`_grpc._tcp.tandem-decode.ns.svc.cluster.local`) as SRV records, each pod with its own port.
//! A name that fails to resolve keeps its last addresses (a DNS blip must not empty the pool);
//! a worker that is gone is found by the pool's own probes meanwhile.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::watch;

use super::{publish, Published};
use crate::workers::WorkerAddr;

/// Turns a `host:port` name into the addresses it stands for now.
pub trait Resolve: Send + Sync + 'static {
    /// The addresses `name` resolves to.
    fn resolve(&self, name: &str) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>>;
}

/// DNS through hickory: a `host:port` name is looked up as A/AAAA records (every address with
/// that port), a name without a port as SRV records (each target's addresses with the record's
/// port: a headless Service's `_grpc._tcp.<service>.<ns>.svc.cluster.local` names one record per
/// ready pod). Answers are cached no longer than their TTL.
pub struct DnsResolver {
    resolver: hickory_resolver::TokioResolver,
}

impl DnsResolver {
    /// Through the system's configuration (`/etc/resolv.conf`: in a pod, the cluster's DNS), or
    /// through the nameserver at `server` (`ip:port`) alone.
    pub fn new(server: Option<SocketAddr>) -> Result<Self, String> {
        use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
        use hickory_resolver::net::runtime::TokioRuntimeProvider;
        let builder = match server {
            None => hickory_resolver::TokioResolver::builder_tokio()
                .map_err(|e| format!("reading the system's DNS configuration: {e}"))?,
            Some(addr) => {
                let mut udp = ConnectionConfig::udp();
                udp.port = addr.port();
                let mut tcp = ConnectionConfig::tcp();
                tcp.port = addr.port();
                let ns = NameServerConfig::new(addr.ip(), true, vec![udp, tcp]);
                hickory_resolver::TokioResolver::builder_with_config(
                    ResolverConfig::from_parts(None, Vec::new(), vec![ns]),
                    TokioRuntimeProvider::default(),
                )
            }
        };
        let resolver = builder
            .build()
            .map_err(|e| format!("starting the DNS resolver: {e}"))?;
        Ok(Self { resolver })
    }
}

fn io(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

impl Resolve for DnsResolver {
    fn resolve(&self, name: &str) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
        let resolver = self.resolver.clone();
        let name = name.to_string();
        Box::pin(async move {
            let targets: Vec<(String, u16)> = match name.rsplit_once(':') {
                Some((host, port)) => {
                    let port = port
                        .parse()
                        .map_err(|_| io(format!("{name}: the port is not a number")))?;
                    vec![(host.to_string(), port)]
                }
                None => match resolver.srv_lookup(name.as_str()).await {
                    Ok(found) => found,
                    // The name exists with no records: a Service with no ready pod.
                    Err(e) if e.is_no_records_found() && !e.is_nx_domain() => return Ok(Vec::new()),
                    Err(e) => return Err(io(e)),
                }
                .answers()
                .iter()
                .filter_map(|r| match &r.data {
                    hickory_resolver::proto::rr::RData::SRV(srv) => {
                        Some((srv.target.to_string(), srv.port))
                    }
                    _ => None,
                })
                .collect(),
            };
            let mut out = Vec::new();
            for (host, port) in targets {
                if let Ok(ip) = host.parse::<std::net::IpAddr>() {
                    out.push(SocketAddr::new(ip, port));
                    continue;
                }
                let ips = resolver.lookup_ip(host.as_str()).await.map_err(io)?;
                out.extend(ips.iter().map(|ip| SocketAddr::new(ip, port)));
            }
            Ok(out)
        })
    }
}

/// Decode and prefill workers found by re-resolving DNS names.
pub struct DnsDiscovery;

struct Group {
    names: Vec<String>,
    last: HashMap<String, Vec<SocketAddr>>,
    tx: watch::Sender<Vec<WorkerAddr>>,
}

impl Group {
    async fn refresh(&mut self, resolver: &dyn Resolve) {
        for name in &self.names {
            match resolver.resolve(name).await {
                Ok(addrs) => {
                    self.last.insert(name.clone(), addrs);
                }
                Err(e) => {
                    tracing::warn!(%name, error = %e, "DNS lookup failed; keeping the last addresses")
                }
            }
        }
        let all = self
            .last
            .values()
            .flatten()
            .map(|a| WorkerAddr::from(a.to_string()))
            .collect();
        publish(&self.tx, all);
    }
}

impl DnsDiscovery {
    /// Resolves `decode` and `prefill` (`host:port` names) now, then every `refresh`.
    pub async fn start(
        decode: Vec<String>,
        prefill: Vec<String>,
        refresh: Duration,
        resolver: Arc<dyn Resolve>,
    ) -> Published {
        let (lists, decode_tx, prefill_tx) = Published::empty();
        let group = |names: Vec<String>, tx| Group {
            names,
            last: HashMap::new(),
            tx,
        };
        let mut groups = [group(decode, decode_tx), group(prefill, prefill_tx)];
        for g in &mut groups {
            g.refresh(resolver.as_ref()).await;
        }
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(refresh);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                for g in &mut groups {
                    g.refresh(resolver.as_ref()).await;
                }
            }
        });
        lists.kept_by(task)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::discovery::Discovery;

    /// A resolver whose answers the test sets; a name with no answer fails to resolve.
    #[derive(Default)]
    struct Table(Mutex<HashMap<String, Vec<SocketAddr>>>);

    impl Table {
        fn set(&self, name: &str, addrs: &[&str]) {
            let addrs = addrs.iter().map(|a| a.parse().unwrap()).collect();
            self.0.lock().unwrap().insert(name.into(), addrs);
        }
    }

    impl Resolve for Arc<Table> {
        fn resolve(&self, name: &str) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
            let r = self.0.lock().unwrap().get(name).cloned();
            Box::pin(async move {
                r.ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "NXDOMAIN"))
            })
        }
    }

    fn list(rx: &watch::Receiver<Vec<WorkerAddr>>) -> Vec<String> {
        rx.borrow().iter().map(|a| a.to_string()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn follows_the_records_and_keeps_the_last_answer_on_a_failed_lookup() {
        let table = Arc::new(Table::default());
        table.set("decode.ns.svc:50100", &["10.0.0.2:50100", "10.0.0.1:50100"]);
        let d = DnsDiscovery::start(
            vec!["decode.ns.svc:50100".into()],
            vec!["prefill.ns.svc:50200".into()],
            Duration::from_secs(2),
            Arc::new(table.clone()),
        )
        .await;
        let mut decode = d.decode_workers();
        let prefill = d.prefill_workers();
        assert_eq!(list(&decode), ["10.0.0.1:50100", "10.0.0.2:50100"]);
        assert!(list(&prefill).is_empty());

        // A pod goes, another comes, the prefill group appears: seen at the next refresh.
        table.set("decode.ns.svc:50100", &["10.0.0.2:50100", "10.0.0.3:50100"]);
        table.set("prefill.ns.svc:50200", &["10.0.1.1:50200"]);
        decode.changed().await.unwrap();
        assert_eq!(list(&decode), ["10.0.0.2:50100", "10.0.0.3:50100"]);
        assert_eq!(list(&prefill), ["10.0.1.1:50200"]);

        // The name stops resolving: the last addresses stay.
        table.0.lock().unwrap().remove("decode.ns.svc:50100");
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(list(&decode), ["10.0.0.2:50100", "10.0.0.3:50100"]);
        // An answer with no pods empties the group.
        table.set("decode.ns.svc:50100", &[]);
        decode.changed().await.unwrap();
        assert!(list(&decode).is_empty());
    }
}
