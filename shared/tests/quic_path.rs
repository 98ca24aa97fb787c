//! The cluster's QUIC settings on a real loopback connection (mutual TLS, the endpoints the node
//! and coordinator use): path-MTU discovery climbs above Ethernet's 1,472 bytes, and large
//! answers (a prefill's megabytes of results) cross without a single packet declared lost.
//! Guards two ways this went wrong: quinn's default endpoint payload limit silently capped
//! discovery at 1,472 bytes, and an upper bound above ~6,500 made segmentation-offload sends
//! exceed 64 KB — the kernel refused them (EMSGSIZE), quinn dropped them unseen, and a third of
//! all packets were "lost" and resent after a timeout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ternfleet_shared::mtls::{init_ca, issue, Identity, MTU_UPPER_BOUND};
use ternfleet_shared::net::{endpoint, read_frame, write_frame, QuicTransport, Transport};
use ternfleet_shared::wire::{Call, Frame, NodeState, WireRoute};

#[test]
fn large_answers_cross_loopback_in_large_packets_without_loss() {
    let dir = tempfile::tempdir().unwrap();
    init_ca(dir.path()).unwrap();
    issue(dir.path(), "n1").unwrap();
    issue(dir.path(), "coordinator").unwrap();
    let node = Identity::load(dir.path(), "n1").unwrap();
    let me = Identity::load(dir.path(), "coordinator").unwrap();

    // A node stand-in: answers a Hello with its status and any Call with 1 MiB of results.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let ep = {
        let _g = rt.enter();
        endpoint(
            "127.0.0.1:0".parse().unwrap(),
            Some(node.server_config().unwrap()),
        )
        .unwrap()
    };
    let addr = ep.local_addr().unwrap();
    let rows: Vec<f32> = (0..(1 << 18)).map(|i| i as f32 * 0.25).collect();
    let answer = Arc::new(
        Frame::Result {
            cols: 2048,
            rows: rows.clone(),
        }
        .encode()
        .unwrap(),
    );
    let (conn_tx, conn_rx) = std::sync::mpsc::channel();
    rt.spawn(async move {
        while let Some(inc) = ep.accept().await {
            let Ok(conn) = inc.await else { continue };
            let _ = conn_tx.send(conn.clone());
            let answer = answer.clone();
            tokio::spawn(async move {
                while let Ok((mut s, mut r)) = conn.accept_bi().await {
                    let answer = answer.clone();
                    tokio::spawn(async move {
                        let bytes = match read_frame(&mut r).await {
                            Ok(Frame::Hello { .. }) => Frame::Status {
                                id: "n1".into(),
                                kernels: "test".into(),
                                exact: true,
                                bundle: String::new(),
                                state: NodeState::Ready,
                            }
                            .encode()
                            .unwrap(),
                            _ => (*answer).clone(),
                        };
                        let _ = write_frame(&mut s, &bytes).await;
                    });
                }
            });
        }
    });

    let t = QuicTransport::new(&me, &[("n1".into(), addr.to_string())]).unwrap();
    let call = Frame::Call(Call {
        layer: 0,
        numerics: Default::default(),
        ty: ternfleet_kernels::GgmlType::F32,
        n_tokens: 1,
        cols: 2048,
        routes: (0..128)
            .map(|e| WireRoute {
                token: 0,
                expert: e,
            })
            .collect(),
        input: vec![0u8; 2048 * 4],
        trace: None,
    });
    let req = Arc::new(call.encode().unwrap());
    let started = Instant::now();
    for i in 0..60 {
        let got = t
            .send(0, req.clone(), Instant::now() + Duration::from_secs(20))
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("call {i}: no answer: {e}"))
            .unwrap_or_else(|e| panic!("call {i}: {e}"));
        match got {
            Frame::Result { rows: r, .. } => assert!(r == rows, "call {i}: wrong results"),
            other => panic!("call {i}: answered {other:?}"),
        }
    }
    let conn = conn_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the node saw the connection");
    let st = conn.stats();
    eprintln!(
        "60 calls of 1 MiB answers in {:?}: path MTU {}, {} packets sent, {} lost",
        started.elapsed(),
        st.path.current_mtu,
        st.path.sent_packets,
        st.path.lost_packets
    );
    assert!(
        st.path.current_mtu > 1472 && st.path.current_mtu <= MTU_UPPER_BOUND,
        "path MTU {} on loopback (discovery should reach (1472, {MTU_UPPER_BOUND}])",
        st.path.current_mtu
    );
    assert_eq!(st.path.lost_packets, 0, "packets lost on loopback");
    drop(t);
    rt.shutdown_timeout(Duration::from_secs(1));
}
