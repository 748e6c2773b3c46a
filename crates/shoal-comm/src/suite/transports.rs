//! Transport specifics: FIFO matching of several messages per peer in one exchange, large
//! messages both ways at once (no deadlock on full buffers), shared-memory joining and its
//! checks, TCP mesh setup with hellos, and link emulation (latency and bandwidth, checked
//! with loose bounds only).

use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{on_ranks, world, KINDS};
use crate::{
    connect_mesh, mem_mesh, CommError, Communicator, EmulatedLink, Group, LinkSpec, ShmTransport,
    Transport,
};

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

fn pattern(len: usize, salt: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ salt) as u8)
        .collect()
}

#[test]
fn several_messages_per_peer_keep_fifo_order() {
    for kind in KINDS {
        let ts = world(kind, 3);
        let sizes = [0usize, 5, 100_000, 17, 3];
        on_ranks(&ts, |r, t| {
            let peers: Vec<usize> = (0..3).filter(|&p| p != r).collect();
            let msgs: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| pattern(n, r * 10 + i))
                .collect();
            let sends: Vec<(usize, &[u8])> = peers
                .iter()
                .flat_map(|&p| msgs.iter().map(move |m| (p, m.as_slice())))
                .collect();
            let mut bufs: Vec<Vec<u8>> = peers
                .iter()
                .flat_map(|_| sizes.iter().map(|&n| vec![0u8; n]))
                .collect();
            let mut recvs: Vec<(usize, &mut [u8])> = bufs
                .iter_mut()
                .enumerate()
                .map(|(k, b)| (peers[k / sizes.len()], b.as_mut_slice()))
                .collect();
            t.exchange(&sends, &mut recvs, soon()).unwrap();
            for (k, b) in bufs.iter().enumerate() {
                let (p, i) = (peers[k / sizes.len()], k % sizes.len());
                assert!(
                    *b == pattern(sizes[i], p * 10 + i),
                    "{kind:?} rank {r} from {p} msg {i}"
                );
            }
        });
    }
}

#[test]
fn large_messages_both_ways_do_not_deadlock() {
    for kind in KINDS {
        let ts = world(kind, 2);
        let len = 8 << 20;
        on_ranks(&ts, |r, t| {
            let out = pattern(len, r);
            let mut inb = vec![0u8; len];
            t.exchange(&[(1 - r, &out)], &mut [(1 - r, &mut inb)], soon())
                .unwrap();
            assert!(inb == pattern(len, 1 - r), "{kind:?}");
        });
    }
}

fn shm_path(tag: &str) -> std::path::PathBuf {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    dir.join(format!("shoal-test-{tag}-{}", std::process::id()))
}

#[test]
fn shm_streams_a_large_message_through_a_small_ring() {
    let path = shm_path("small-ring");
    let ts: Vec<Arc<dyn Transport>> = (0..2)
        .map(|r| Arc::new(ShmTransport::join(&path, r, 2, 4096, soon()).unwrap()) as _)
        .collect();
    assert!(
        !path.exists(),
        "the file's name is removed once every rank joined"
    );
    on_ranks(&ts, |r, t| {
        let g = Group::world(Arc::clone(t));
        let msg = pattern(1 << 20, 5);
        if r == 0 {
            g.send(1, &msg).unwrap();
        } else {
            let mut b = vec![0u8; msg.len()];
            g.recv(0, &mut b).unwrap();
            assert!(b == msg);
        }
    });
}

#[test]
fn shm_join_checks_the_header() {
    let path = shm_path("mismatch");
    let t0 = ShmTransport::join(&path, 0, 3, 8192, soon()).unwrap();
    let quick = || Instant::now() + Duration::from_secs(2);
    let e = ShmTransport::join(&path, 1, 4, 8192, quick())
        .err()
        .unwrap();
    assert!(
        matches!(e, CommError::Protocol { .. }) && e.to_string().contains("3 ranks"),
        "{e}"
    );
    let e = ShmTransport::join(&path, 1, 3, 1 << 20, quick())
        .err()
        .unwrap();
    assert!(
        matches!(e, CommError::Protocol { .. }) && e.to_string().contains("8192"),
        "{e}"
    );
    let t1 = ShmTransport::join(&path, 1, 3, 8192, quick()).unwrap();
    let e = ShmTransport::join(&path, 1, 3, 8192, quick())
        .err()
        .unwrap();
    assert!(e.to_string().contains("already joined"), "{e}");
    drop((t0, t1));
    assert!(!path.exists(), "a dropped transport removes the file");
    // Nobody creates it: a joiner gives up at its deadline.
    let start = Instant::now();
    let e = ShmTransport::join(
        shm_path("nobody"),
        1,
        2,
        8192,
        Instant::now() + Duration::from_millis(200),
    )
    .err()
    .unwrap();
    assert!(matches!(e, CommError::Timeout { peer: 0, .. }), "{e}");
    assert!(start.elapsed() < Duration::from_secs(3));
}

fn listeners(n: usize) -> (Vec<TcpListener>, Vec<std::net::SocketAddr>) {
    let ls: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    (ls, addrs)
}

#[test]
fn connect_mesh_builds_a_working_world() {
    let n = 4;
    let (ls, addrs) = listeners(n);
    let ts: Vec<Arc<dyn Transport>> = std::thread::scope(|s| {
        let hs: Vec<_> = ls
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let addrs = &addrs;
                s.spawn(move || connect_mesh(r, l, addrs, soon()).unwrap())
            })
            .collect();
        hs.into_iter()
            .map(|h| Arc::new(h.join().unwrap()) as _)
            .collect()
    });
    let sums = on_ranks(&ts, |r, t| {
        let g = Group::world(Arc::clone(t));
        let mut x = vec![r as f32; 10];
        g.all_reduce_sum(&mut x).unwrap();
        x[0]
    });
    assert_eq!(sums, vec![6.0; n]);
}

#[test]
fn connect_mesh_rejects_a_different_world_size() {
    let (mut ls, addrs) = listeners(2);
    let l1 = ls.pop().unwrap();
    let l0 = ls.pop().unwrap();
    let (r0, r1) = std::thread::scope(|s| {
        let addrs = &addrs;
        let a =
            s.spawn(move || connect_mesh(0, l0, addrs, Instant::now() + Duration::from_secs(5)));
        // Rank 1 believes in a world of 3 (a third address that nobody serves).
        let mut wrong = addrs.clone();
        wrong.push(addrs[0]);
        let b =
            s.spawn(move || connect_mesh(1, l1, &wrong, Instant::now() + Duration::from_secs(5)));
        (a.join().unwrap(), b.join().unwrap())
    });
    let e = r0.err().unwrap();
    assert!(
        matches!(e, CommError::Protocol { .. }) && e.to_string().contains("3 ranks"),
        "{e}"
    );
    assert!(r1.is_err());
}

#[test]
fn emulated_link_adds_latency() {
    let latency_us = 3000.0;
    let ts: Vec<Arc<dyn Transport>> = mem_mesh(2)
        .into_iter()
        .map(|t| Arc::new(EmulatedLink::new(t, LinkSpec::new(latency_us, 0.0))) as _)
        .collect();
    let rounds = 10;
    let took = on_ranks(&ts, |r, t| {
        let g = Group::world(Arc::clone(t));
        let mut b = [0u8; 64];
        let start = Instant::now();
        for _ in 0..rounds {
            if r == 0 {
                g.send(1, &b).unwrap();
                g.recv(1, &mut b).unwrap();
            } else {
                g.recv(0, &mut b).unwrap();
                g.send(0, &b).unwrap();
            }
        }
        start.elapsed()
    });
    let floor = Duration::from_micros((2.0 * latency_us) as u64 * rounds);
    assert!(took[0] >= floor, "{:?} < {floor:?}", took[0]);
    assert!(took[0] < floor * 20, "{:?}", took[0]);
}

#[test]
fn emulated_link_respects_bandwidth_without_blocking_the_sender() {
    // 0.05 Gbit/s: 250 kB take 40 ms on the wire; two back-to-back messages 80 ms.
    let ts: Vec<Arc<dyn Transport>> = mem_mesh(2)
        .into_iter()
        .map(|t| Arc::new(EmulatedLink::new(t, LinkSpec::new(100.0, 0.05))) as _)
        .collect();
    let len = 250_000;
    // Measured from before either rank starts: the sender stamps no earlier than this.
    let t0 = Instant::now();
    let took = on_ranks(&ts, |r, t| {
        let start = if r == 0 { Instant::now() } else { t0 };
        let msg = vec![7u8; len];
        if r == 0 {
            t.exchange(&[(1, &msg[..]), (1, &msg[..])], &mut [], soon())
                .unwrap();
        } else {
            let (mut a, mut b) = (vec![0u8; len], vec![0u8; len]);
            t.exchange(&[], &mut [(0, &mut a[..]), (0, &mut b[..])], soon())
                .unwrap();
            assert!(a == msg && b == msg);
        }
        start.elapsed()
    });
    assert!(
        took[1] >= Duration::from_millis(78),
        "receiver after {:?}",
        took[1]
    );
    assert!(
        took[1] < Duration::from_secs(4),
        "receiver after {:?}",
        took[1]
    );
    assert!(
        took[0] < Duration::from_millis(40),
        "sender blocked for {:?}",
        took[0]
    );
}
