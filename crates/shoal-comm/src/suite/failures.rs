//! How failures surface: a peer that sends a message of the wrong length or protocol
//! version (a [`CommError::Protocol`] error), a peer that drops its transport (a
//! [`CommError::Link`] error on the others, quickly), a silent peer (a
//! [`CommError::Timeout`] at the deadline), and a transport broken by an earlier error.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{on_ranks, world, Kind, KINDS};
use crate::frame::{self, PROTOCOL_VERSION};
use crate::{CommError, Communicator, Group, TcpTransport, Transport};

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

#[test]
fn wrong_length_is_a_protocol_error_on_every_transport() {
    for kind in KINDS {
        let ts = world(kind, 2);
        let got = on_ranks(&ts, |r, t| {
            if r == 0 {
                t.exchange(&[(1, &[1u8; 8][..])], &mut [], soon())
            } else {
                t.exchange(&[], &mut [(0, &mut [0u8; 12][..])], soon())
            }
        });
        assert!(got[0].is_ok(), "{kind:?}: {:?}", got[0]);
        match &got[1] {
            Err(CommError::Protocol {
                rank: 1,
                peer: 0,
                reason,
            }) => {
                assert!(
                    reason.contains("8 bytes") && reason.contains("expected 12"),
                    "{reason}"
                );
            }
            other => panic!("{kind:?}: expected a protocol error, got {other:?}"),
        }
    }
}

/// A transport of rank 0 whose only peer is a raw socket the test writes to.
fn raw_pair() -> (TcpTransport, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let raw = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (
        TcpTransport::from_streams(0, vec![None, Some(s)]).unwrap(),
        raw,
    )
}

#[test]
fn wrong_version_and_garbage_frames_are_protocol_errors() {
    let (t, mut raw) = raw_pair();
    let mut h = frame::encode(4);
    h[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    raw.write_all(&h).unwrap();
    raw.write_all(&[0; 4]).unwrap();
    let e = t
        .exchange(&[], &mut [(1, &mut [0u8; 4][..])], soon())
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            CommError::Protocol {
                rank: 0,
                peer: 1,
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("version {}", PROTOCOL_VERSION + 1)),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("version {PROTOCOL_VERSION}")),
        "{msg}"
    );

    let (t, mut raw) = raw_pair();
    raw.write_all(&[0xAB; 64]).unwrap();
    let e = t
        .exchange(&[], &mut [(1, &mut [0u8; 48][..])], soon())
        .unwrap_err();
    assert!(e.to_string().contains("magic"), "{e}");

    // A huge announced length is rejected without allocating or waiting for it.
    let (t, mut raw) = raw_pair();
    let mut h = frame::encode(0);
    h[8..16].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    raw.write_all(&h).unwrap();
    let e = t
        .exchange(&[], &mut [(1, &mut [0u8; 16][..])], soon())
        .unwrap_err();
    assert!(matches!(e, CommError::Protocol { .. }), "{e}");
}

#[test]
fn dropped_peer_is_a_link_error_quickly() {
    for kind in KINDS {
        let mut ts = world(kind, 3);
        drop(ts.pop()); // rank 2 goes away before the collective
        let start = Instant::now();
        let got = on_ranks(&ts, |_, t| {
            let g = Group::world(Arc::clone(t)).with_timeout(Duration::from_secs(20));
            let mut x = vec![1.0f32; 100];
            g.all_reduce_sum(&mut x)
        });
        let took = start.elapsed();
        for (r, res) in got.iter().enumerate() {
            assert!(
                matches!(res, Err(CommError::Link { .. })),
                "{kind:?} rank {r}: {res:?}"
            );
        }
        assert!(took < Duration::from_secs(5), "{kind:?}: took {took:?}");
    }
}

#[test]
fn peer_dropping_mid_stream_is_a_link_error() {
    for kind in [Kind::Tcp, Kind::Shm, Kind::Mem] {
        let ts = world(kind, 2);
        let mut ts = ts.into_iter();
        let (t0, t1) = (ts.next().unwrap(), ts.next().unwrap());
        let start = Instant::now();
        std::thread::scope(|s| {
            s.spawn(move || {
                // Take part of a large message, then vanish.
                let mut buf = vec![0u8; 1000];
                let _ = t1.exchange(&[], &mut [(0, &mut buf[..])], soon());
                drop(t1);
            });
            let g = Group::world(t0).with_timeout(Duration::from_secs(20));
            let mut back = vec![0u8; 4 << 20];
            let sent = g.send(1, &back);
            let res = sent.and_then(|()| g.recv(1, &mut back));
            assert!(
                matches!(res, Err(CommError::Link { peer: 1, .. })),
                "{kind:?}: {res:?}"
            );
        });
        assert!(start.elapsed() < Duration::from_secs(5), "{kind:?}");
    }
}

#[test]
fn silent_peer_times_out_at_the_deadline() {
    for kind in KINDS {
        let ts = world(kind, 2);
        let g = Group::world(Arc::clone(&ts[0])).with_timeout(Duration::from_millis(300));
        let start = Instant::now();
        let e = g.all_reduce_sum(&mut [1.0; 16]).unwrap_err();
        let took = start.elapsed();
        assert!(
            matches!(
                e,
                CommError::Timeout {
                    rank: 0,
                    peer: 1,
                    ..
                }
            ),
            "{kind:?}: {e}"
        );
        assert!(took >= Duration::from_millis(300), "{kind:?}: {took:?}");
        assert!(took < Duration::from_millis(2300), "{kind:?}: {took:?}");
        // The stream may be mid-message now: the transport refuses further use...
        let e = g.all_reduce_sum(&mut [1.0; 16]).unwrap_err();
        assert!(e.to_string().contains("earlier error"), "{kind:?}: {e}");
        // ...and its peer, after taking what was sent before, learns at once instead of
        // waiting for its own deadline.
        let g1 = Group::world(Arc::clone(&ts[1])).with_timeout(Duration::from_secs(20));
        let start = Instant::now();
        let mut x = [0u8; 64];
        g1.recv(0, &mut x).unwrap();
        let e = g1.recv(0, &mut x).unwrap_err();
        assert!(
            matches!(e, CommError::Link { peer: 0, .. }),
            "{kind:?}: {e}"
        );
        assert!(start.elapsed() < Duration::from_secs(5), "{kind:?}");
    }
}
