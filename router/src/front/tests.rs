use std::time::Duration;

use super::conn::{Conn, Wire, OPENING_BYTES};
use super::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn keys(k: &[&str]) -> ApiKeys {
    ApiKeys::new(&k.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
}

#[test]
fn keys_accept_a_bearer_token_of_any_listed_key_and_nothing_else() {
    let k = keys(&["alpha", "beta-2"]);
    assert!(k.check(Some(b"Bearer alpha")).is_ok());
    assert!(k.check(Some(b"bearer beta-2")).is_ok());
    assert!(k.check(Some(b"Bearer  beta-2 ")).is_ok());
    assert_eq!(
        k.check(Some(b"Bearer alph")),
        Err("incorrect API key provided".into())
    );
    assert_eq!(
        k.check(Some(b"Bearer alpha2")),
        Err("incorrect API key provided".into())
    );
    assert!(k
        .check(Some(b"Basic alpha"))
        .unwrap_err()
        .contains("Bearer KEY"));
    assert!(k.check(Some(b"alpha")).unwrap_err().contains("Bearer KEY"));
    assert!(k.check(Some(b"Bearer \xff")).is_err());
    assert!(k.check(None).unwrap_err().contains("no API key"));
    // No keys: open.
    assert!(keys(&[]).check(None).is_ok());
    assert!(keys(&[]).is_open());
    // A key that could never be sent is refused at start.
    for bad in ["", "a b", "tab\there"] {
        assert!(matches!(
            ApiKeys::new(&[bad.to_string()]),
            Err(FrontDoorError::BadKey)
        ));
    }
}

#[test]
fn a_key_file_adds_its_keys_and_an_empty_one_is_refused() {
    let dir = std::env::temp_dir().join(format!("tandem-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("keys");
    std::fs::write(&file, "# team keys\n\n  from-file-1 \nfrom-file-2\n").unwrap();
    let args = FrontDoorArgs {
        api_keys: vec!["flag-key".into()],
        api_key_file: Some(file.clone()),
        ..Default::default()
    };
    let door = args.resolve().unwrap();
    for ok in ["flag-key", "from-file-1", "from-file-2"] {
        assert!(
            door.api_keys
                .check(Some(format!("Bearer {ok}").as_bytes()))
                .is_ok(),
            "{ok}"
        );
    }
    assert!(door.api_keys.check(Some(b"Bearer # team keys")).is_err());
    assert!(door.metrics_keys.is_open());

    std::fs::write(&file, "# nothing here\n\n").unwrap();
    assert!(matches!(args.resolve(), Err(FrontDoorError::NoKeys(_))));
    let missing = FrontDoorArgs {
        api_key_file: Some(dir.join("absent")),
        ..Default::default()
    };
    assert!(matches!(
        missing.resolve(),
        Err(FrontDoorError::KeyFile { .. })
    ));
    let zero = FrontDoorArgs {
        header_timeout_ms: 0,
        ..Default::default()
    };
    assert!(matches!(
        zero.resolve(),
        Err(FrontDoorError::TooSmall("header-timeout-ms", 1))
    ));
    // A budget for bodies in flight that one body of the largest size could not fit.
    let tight = FrontDoorArgs {
        max_body_bytes: 1 << 20,
        max_body_bytes_in_flight: (1 << 20) - 1,
        ..Default::default()
    };
    let e = tight.resolve().err().expect("refused");
    assert!(
        matches!(e, FrontDoorError::TooSmall("max-body-bytes-in-flight", n) if n == 1 << 20),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tls_files_that_are_not_pem_are_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("tandem-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, "not a certificate").unwrap();
    std::fs::write(&key, "not a key").unwrap();
    let args = FrontDoorArgs {
        tls_cert: Some(cert),
        tls_key: Some(key),
        ..Default::default()
    };
    match args.resolve() {
        Err(FrontDoorError::Pem { what, .. }) => assert_eq!(what, "certificate"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("garbage accepted as a certificate"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn limits(header: u64, write: u64) -> ConnLimits {
    ConnLimits {
        max_body: 1 << 20,
        max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
        max_headers: DEFAULT_MAX_HEADERS,
        header_timeout: Duration::from_millis(header),
        body_stall: Duration::from_secs(10),
        body_deadline: Duration::from_secs(60),
        body_in_flight: 1 << 24,
        write_stall: Duration::from_millis(write),
    }
}

/// A connected pair: the server side as a [`Conn`], and the client's socket.
async fn pair(l: ConnLimits) -> (Conn, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (server, _) = listener.accept().await.unwrap();
    (Conn::new(Wire::Plain(server), &l), client)
}

#[tokio::test]
async fn a_client_that_never_reads_is_cut_off_after_the_write_stall() {
    let (mut conn, client) = pair(limits(10_000, 300)).await;
    let chunk = vec![7u8; 64 << 10];
    let mut written = 0usize;
    // The socket buffers fill, then writes stall; the stall becomes an error however long
    // the filling took.
    let err = loop {
        match conn.write(&chunk).await {
            Ok(n) => written += n,
            Err(e) => break e,
        }
    };
    assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
    assert!(written > 0);
    drop(client);
}

#[tokio::test]
async fn a_slow_reader_that_keeps_reading_is_never_cut_off() {
    // A write stall limit of 10 s against the reader's pauses of 20 ms: only a reader that
    // stops would meet it, not a machine that holds the test up for a second.
    let (mut conn, mut client) = pair(limits(10_000, 10_000)).await;
    let total = 8usize << 20;
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        let mut got = 0;
        while got < total {
            let n = client.read(&mut buf).await.unwrap();
            assert!(n > 0);
            got += n;
            // Slower than the writer, but never idle for the stall timeout.
            if got % (256 << 10) < 4096 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        got
    });
    let chunk = vec![1u8; 64 << 10];
    for _ in 0..total / chunk.len() {
        conn.write_all(&chunk).await.unwrap();
    }
    conn.flush().await.unwrap();
    assert_eq!(reader.await.unwrap(), total);
}

#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_after_the_header_timeout() {
    let (mut conn, _client) = pair(limits(200, 10_000)).await;
    let mut buf = [0u8; 64];
    let err = conn.read(&mut buf).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
}

#[tokio::test]
async fn once_a_request_has_begun_the_opening_deadline_is_lifted() {
    let (mut conn, mut client) = pair(limits(200, 10_000)).await;
    client.write_all(&[b'x'; OPENING_BYTES]).await.unwrap();
    let mut buf = [0u8; 64];
    let mut got = 0;
    while got < OPENING_BYTES {
        got += conn.read(&mut buf[got..]).await.unwrap();
    }
    // Past the deadline, a read still waits for data rather than failing.
    let later = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(600)).await;
        client.write_all(b"more").await.unwrap();
        client
    });
    let n = conn.read(&mut buf).await.unwrap();
    assert_eq!(&buf[..n], b"more");
    drop(later.await.unwrap());
}
