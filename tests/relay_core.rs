//! Black-box tests of the relay core (SPEC §5.2, §5.3 db mode) on the combined role with
//! SQLite: the real binary, real sockets, a real WebSocket client.

mod harness;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use harness::*;
use tungstenite::Message;

#[test]
fn desktop_and_phone_splice_text_and_binary_both_ways_unchanged() {
    let relay = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&relay);
    assert_eq!(desktop.generation, 1);
    let (mut phone, mut leg) = splice(&relay, &mut desktop);

    let sizes = [1usize, 125, 126, 65_535, 65_536, 1 << 20, 8 * 1024 * 1024];
    for (i, size) in sizes.iter().enumerate() {
        let payload: Vec<u8> = (0..*size).map(|n| (n * 31 + i) as u8).collect();
        phone.send(Message::binary(payload.clone())).unwrap();
        match leg.read().unwrap() {
            Message::Binary(got) => assert_eq!(&got[..], &payload[..], "phone->host {size} B"),
            other => panic!("expected binary, got {other:?}"),
        }
        leg.send(Message::binary(payload.clone())).unwrap();
        match phone.read().unwrap() {
            Message::Binary(got) => assert_eq!(&got[..], &payload[..], "host->phone {size} B"),
            other => panic!("expected binary, got {other:?}"),
        }
        let text: String = "é"
            .repeat(size / 2 + 1)
            .chars()
            .take(*size.min(&100_000))
            .collect();
        phone.send(Message::text(text.clone())).unwrap();
        match leg.read().unwrap() {
            Message::Text(got) => assert_eq!(got.as_str(), text),
            other => panic!("expected text, got {other:?}"),
        }
        leg.send(Message::text(text.clone())).unwrap();
        match phone.read().unwrap() {
            Message::Text(got) => assert_eq!(got.as_str(), text),
            other => panic!("expected text, got {other:?}"),
        }
    }
    assert!(
        relay
            .metric("orca_relay_splice_bytes_total{direction=\"phone_to_host\"}")
            .unwrap()
            > 9e6
    );
}

#[test]
fn wrong_epoch_is_refused_4409() {
    let relay = Relay::combined(&[]);
    let relay_host_id = host_id();
    let token = token("u-wrong-epoch", &relay_host_id);
    let epoch = assign(&relay, &token, &relay_host_id);
    let mut control = ws_connect(&relay.ws_url("/v1/host/control"), Some(&token)).unwrap();
    send_json(
        &mut control,
        serde_json::json!({"type":"host-hello","v":1,"relayHostId":relay_host_id,"assignmentEpoch":epoch + 1}),
    );
    assert_eq!(read_close(&mut control), Some(4409));
    // The right epoch is still admitted afterwards.
    let mut control = ws_connect(&relay.ws_url("/v1/host/control"), Some(&token)).unwrap();
    send_json(
        &mut control,
        serde_json::json!({"type":"host-hello","v":1,"relayHostId":relay_host_id,"assignmentEpoch":epoch}),
    );
    assert_eq!(read_json(&mut control)["type"], "host-hello-ack");
}

fn hs256(claims: serde_json::Value, key: &[u8]) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(key).unwrap(),
    )
    .unwrap()
}

fn b64(data: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(data)
}

#[test]
fn bad_tokens_are_refused_401_at_upgrade() {
    let relay = Relay::combined(&[]);
    let url = relay.ws_url("/v1/host/control");
    let now = orca_relay::clock::system().now_ms() / 1000;
    let claims = |aud: &str, exp: u64, purpose: &str| serde_json::json!({"sub":"u1","relayHostId":"abcdefghijklmnop","purpose":purpose,"aud":aud,"exp":exp});
    let key = TEST_KEY.as_bytes();
    let none_token = format!(
        "{}.{}.",
        b64(br#"{"alg":"none","typ":"JWT"}"#),
        b64(claims("orca-relay", now + 600, "host-control")
            .to_string()
            .as_bytes())
    );
    let cases: Vec<(&str, Option<String>)> = vec![
        ("missing", None),
        ("garbage", Some("not-a-jwt".into())),
        (
            "wrong key",
            Some(hs256(
                claims("orca-relay", now + 600, "host-control"),
                b"another-secret-another-secret-xx",
            )),
        ),
        (
            "expired",
            Some(hs256(claims("orca-relay", now - 600, "host-control"), key)),
        ),
        (
            "wrong audience",
            Some(hs256(
                claims("someone-else", now + 600, "host-control"),
                key,
            )),
        ),
        (
            "wrong purpose",
            Some(hs256(claims("orca-relay", now + 600, "phone"), key)),
        ),
        ("alg none", Some(none_token)),
    ];
    for (name, token) in cases {
        let result = ws_connect(&url, token.as_deref());
        assert_eq!(result.err(), Some(401), "{name}");
    }
    assert!(
        relay
            .metric("orca_relay_upgrades_refused_total{status=\"401\",reason=\"missing\"}")
            .is_some()
            || relay.get("/metrics").1.contains("status=\"401\"")
    );
}

#[test]
fn unknown_path_is_404_and_plain_http_is_refused() {
    let relay = Relay::combined(&[]);
    assert_eq!(ws_connect(&relay.ws_url("/nope"), None).err(), Some(404));
    let mut stream = TcpStream::connect(&relay.ws).unwrap();
    stream
        .write_all(b"GET /v1/host/control HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let _ = stream.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 426"), "{answer}");
}

fn control_socket(relay: &Relay) -> (String, Ws) {
    let relay_host_id = host_id();
    let token = token(&format!("u-{relay_host_id}"), &relay_host_id);
    let control = ws_connect(&relay.ws_url("/v1/host/control"), Some(&token)).unwrap();
    (relay_host_id, control)
}

#[test]
fn late_binary_or_malformed_first_frames_close_4401() {
    let relay = Relay::combined(&[("ORCA_RELAY_FIRST_FRAME_MS", "300")]);
    // Late: nothing sent.
    let (_, mut control) = control_socket(&relay);
    let started = orca_relay::clock::instant();
    assert_eq!(read_close(&mut control), Some(4401));
    assert!(started.elapsed() < Duration::from_secs(3));
    // Binary first frame.
    let (_, mut control) = control_socket(&relay);
    control.send(Message::binary(vec![1, 2, 3])).unwrap();
    assert_eq!(read_close(&mut control), Some(4401));
    // Malformed JSON.
    let (_, mut control) = control_socket(&relay);
    control.send(Message::text("{not json")).unwrap();
    assert_eq!(read_close(&mut control), Some(4401));
    // Unknown type.
    let (_, mut control) = control_socket(&relay);
    send_json(&mut control, serde_json::json!({"type":"surprise"}));
    assert_eq!(read_close(&mut control), Some(4401));
    // A hello for another host than the token's.
    let (_, mut control) = control_socket(&relay);
    send_json(
        &mut control,
        serde_json::json!({"type":"host-hello","v":1,"relayHostId":"zzzzzzzzzzzzzzzz","assignmentEpoch":1}),
    );
    assert_eq!(read_close(&mut control), Some(4401));
    // The same rules on the phone and data legs.
    let mut phone = ws_connect(&relay.ws_url("/v1/connect/abcdefghijklmnop"), None).unwrap();
    phone.send(Message::binary(vec![0])).unwrap();
    assert_eq!(read_close(&mut phone), Some(4401));
    let mut leg = ws_connect(&relay.ws_url("/v1/host/data/1-1"), None).unwrap();
    assert_eq!(read_close(&mut leg), Some(4401));
}

#[test]
fn phone_refusals_invite_offline_and_ninth_phone() {
    let relay = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&relay);
    let phone_url = relay.ws_url(&format!("/v1/connect/{}", desktop.relay_host_id));

    // No valid invite: 4401.
    let mut phone = ws_connect(&phone_url, None).unwrap();
    send_json(
        &mut phone,
        serde_json::json!({"type":"relay-auth","v":1,"credential":"forged"}),
    );
    assert_eq!(read_close(&mut phone), Some(4401));

    // Host offline: 4404.
    let mut phone = ws_connect(&relay.ws_url("/v1/connect/offlineofflineof"), None).unwrap();
    send_json(
        &mut phone,
        serde_json::json!({"type":"relay-auth","v":1,"credential":"x"}),
    );
    assert_eq!(read_close(&mut phone), Some(4404));

    // Eight phones are spliced; the ninth gets 4429.
    let mut pairs = Vec::new();
    for _ in 0..8 {
        pairs.push(splice(&relay, &mut desktop));
    }
    let invite = desktop.invite();
    let mut ninth = ws_connect(&phone_url, None).unwrap();
    send_json(
        &mut ninth,
        serde_json::json!({"type":"relay-auth","v":1,"credential":invite}),
    );
    assert_eq!(read_close(&mut ninth), Some(4429));

    // An invite has five attempts.
    drop(pairs);
    assert!(wait_until(Duration::from_secs(5), || relay
        .metric("orca_relay_connections{kind=\"phone\"}")
        == Some(0.0)));
    let invite = desktop.invite();
    for attempt in 0..6 {
        let mut phone = ws_connect(&phone_url, None).unwrap();
        send_json(
            &mut phone,
            serde_json::json!({"type":"relay-auth","v":1,"credential":invite}),
        );
        if attempt < 5 {
            let (conn_id, ticket) = desktop.conn_open();
            let _leg = desktop.data_leg(&relay, &conn_id, &ticket);
            assert_eq!(read_json(&mut phone)["type"], "relay-hello");
        } else {
            assert_eq!(read_close(&mut phone), Some(4401), "the sixth attempt");
        }
    }
}

/// Issue 30: phone legs upgraded on a live desktop's path that never send their `relay-auth`
/// take none of its eight phone places, no relay-thread permit and no unit: with 64 of them
/// pending, the relay-threads gauge and the units are what the desktop alone holds, and eight
/// real phones pair while every one of them is still pending.
#[test]
fn pending_phone_legs_against_a_live_host_take_no_place_permit_or_unit() {
    const PENDING: usize = 64;
    // Every leg and phone comes from this one address: the per-source bound (64 by default)
    // would shed the oldest pending leg for each real phone's upgrade.
    let relay = Relay::combined(&[
        ("ORCA_RELAY_FIRST_FRAME_MS", "5000"),
        ("ORCA_RELAY_PENDING_PER_SOURCE_MAX", "256"),
    ]);
    let mut desktop = Desktop::connect(&relay);
    let threads = r#"orca_relay_relay_threads{state="running"}"#;
    let (threads_before, units_before) = (
        relay.metric(threads),
        relay.metric("orca_relay_connection_units"),
    );
    assert_eq!(units_before, Some(1.0));
    assert_eq!(threads_before, Some(1.0), "the control's thread");
    let phone_url = relay.ws_url(&format!("/v1/connect/{}", desktop.relay_host_id));
    let pending: Vec<Ws> = (0..PENDING)
        .map(|n| {
            let mut leg = ws_connect(&phone_url, None).expect("a phone leg's upgrade");
            if n % 2 == 0 {
                // Half of them ping (the relay answers pings of a pending leg); none authenticates.
                leg.send(Message::Ping(b"hi".to_vec().into())).unwrap();
            }
            leg
        })
        .collect();
    assert!(
        wait_until(Duration::from_secs(2), || relay
            .metric("orca_relay_ws_pending_upgrades")
            == Some(PENDING as f64)),
        "pending: {:?}",
        relay.metric("orca_relay_ws_pending_upgrades")
    );
    assert_eq!(relay.metric(threads), threads_before, "relay threads");
    assert_eq!(relay.metric("orca_relay_connection_units"), units_before);
    // Every phone place is still free: eight phones pair (a refused one would be closed 4429
    // and its desktop never asked for a data leg).
    set_read_timeout(&desktop.control, Some(Duration::from_secs(10)));
    let pairs: Vec<(Ws, Ws)> = (0..8)
        .map(|n| {
            let invite = desktop.invite();
            let mut phone = ws_connect(&phone_url, None).expect("phone upgrade");
            send_json(
                &mut phone,
                serde_json::json!({"type":"relay-auth","v":1,"credential":invite}),
            );
            let conn_open = loop {
                match desktop.control.read() {
                    Ok(Message::Text(text)) if text.contains("conn-open") => break text,
                    Ok(_) => {}
                    Err(e) => panic!(
                        "phone {n} was refused ({:?}): no conn-open ({e})",
                        read_close(&mut phone)
                    ),
                }
            };
            let open: serde_json::Value = serde_json::from_str(&conn_open).unwrap();
            let leg = desktop.data_leg(
                &relay,
                open["connId"].as_str().unwrap(),
                open["connTicket"].as_str().unwrap(),
            );
            assert_eq!(read_json(&mut phone)["type"], "relay-hello");
            (phone, leg)
        })
        .collect();
    assert_eq!(
        relay.metric("orca_relay_ws_pending_upgrades"),
        Some(PENDING as f64),
        "the legs were pending throughout"
    );
    assert_eq!(relay.metric("orca_relay_connection_units"), Some(17.0));
    drop((pairs, pending));
}

#[test]
fn data_leg_that_never_attaches_closes_the_phone_4404() {
    let relay = Relay::combined(&[("ORCA_RELAY_ATTACH_DEADLINE_MS", "500")]);
    let mut desktop = Desktop::connect(&relay);
    let invite = desktop.invite();
    let mut phone = ws_connect(
        &relay.ws_url(&format!("/v1/connect/{}", desktop.relay_host_id)),
        None,
    )
    .unwrap();
    send_json(
        &mut phone,
        serde_json::json!({"type":"relay-auth","v":1,"credential":invite}),
    );
    let (conn_id, ticket) = desktop.conn_open();
    let started = orca_relay::clock::instant();
    assert_eq!(read_close(&mut phone), Some(4404));
    assert!(started.elapsed() >= Duration::from_millis(300));
    // A data leg arriving after the deadline is refused.
    let mut late = desktop.data_leg(&relay, &conn_id, &ticket);
    assert_eq!(read_close(&mut late), Some(4401));
}

#[test]
fn second_control_replaces_the_first_4408() {
    let relay = Relay::combined(&[]);
    let mut first = Desktop::connect(&relay);
    let mut second = ws_connect(&relay.ws_url("/v1/host/control"), Some(&first.token)).unwrap();
    send_json(
        &mut second,
        serde_json::json!({"type":"host-hello","v":1,"relayHostId":first.relay_host_id,"assignmentEpoch":first.epoch}),
    );
    let ack = read_json(&mut second);
    assert_eq!(ack["generation"], 2);
    assert_eq!(read_close(&mut first.control), Some(4408));
}

#[test]
fn either_side_closing_closes_the_other_4408() {
    let relay = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&relay);
    let (mut phone, leg) = splice(&relay, &mut desktop);
    drop(leg);
    assert_eq!(read_close(&mut phone), Some(4408));
    let (phone, mut leg) = splice(&relay, &mut desktop);
    drop(phone);
    assert_eq!(read_close(&mut leg), Some(4408));
}

#[test]
fn frames_over_the_limit_close_1009() {
    let relay = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&relay);
    let (mut phone, mut leg) = splice(&relay, &mut desktop);
    phone
        .send(Message::binary(vec![7u8; 8 * 1024 * 1024 + 1]))
        .unwrap();
    assert_eq!(read_close(&mut phone), Some(1009));
    assert_eq!(read_close(&mut leg), Some(4408));
    // Control frames are limited to 1 MiB.
    desktop
        .control
        .send(Message::text("x".repeat(1024 * 1024 + 1)))
        .unwrap();
    assert_eq!(read_close(&mut desktop.control), Some(1009));
}

#[test]
fn connection_cap_refuses_with_503_and_retry_after() {
    let relay = Relay::combined(&[("ORCA_RELAY_CONNECTION_CAP", "3")]);
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(Desktop::connect(&relay));
    }
    // The cap counts admitted sockets: an upgrade meets it only once it is authenticated.
    let fourth = host_id();
    let bearer = token("user-fourth", &fourth);
    let mut stream = TcpStream::connect(&relay.ws).unwrap();
    stream
        .write_all(format!("GET /v1/host/control HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {bearer}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n").as_bytes())
        .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("Retry-After: 2"), "{answer}");
    drop(held);
    assert!(wait_until(Duration::from_secs(5), || relay
        .metric("orca_relay_connection_units")
        == Some(0.0)));
    let _again = Desktop::connect(&relay);
}

#[test]
fn silent_control_is_closed_4408_and_pings_are_sent() {
    let relay = Relay::combined(&[
        ("ORCA_RELAY_PING_MS", "100"),
        ("ORCA_RELAY_SILENCE_MS", "800"),
    ]);
    let mut desktop = Desktop::connect(&relay);
    // Pings arrive; answering keeps the socket open past the silence window.
    let started = orca_relay::clock::instant();
    let mut pings = 0;
    while started.elapsed() < Duration::from_millis(1500) {
        match desktop.control.read().unwrap() {
            Message::Text(text) => {
                let value: serde_json::Value = serde_json::from_str(&text).unwrap();
                assert_eq!(value["type"], "ping");
                pings += 1;
                send_json(
                    &mut desktop.control,
                    serde_json::json!({"type":"pong","t":value["t"]}),
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(pings >= 5, "{pings} pings");
    // Stop answering: the relay closes 4408 after the silence window.
    let mut code = None;
    let started = orca_relay::clock::instant();
    while code.is_none() && started.elapsed() < Duration::from_secs(5) {
        match desktop.control.read() {
            Ok(Message::Close(frame)) => code = frame.map(|f| u16::from(f.code)),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    assert_eq!(code, Some(4408));
}

#[test]
fn a_stalled_phone_is_closed_4429_without_slowing_another_pair() {
    let relay = Relay::combined(&[("ORCA_RELAY_WEDGE_MS", "1000")]);
    let mut stalled_desktop = Desktop::connect(&relay);
    let (stalled_phone, mut stalled_leg) = splice(&relay, &mut stalled_desktop);
    let mut busy_desktop = Desktop::connect(&relay);
    let (mut busy_phone, mut busy_leg) = splice(&relay, &mut busy_desktop);

    // The stalled phone never reads. Its host keeps writing until the relay gives up.
    let writer = orca_relay::threads::spawn("test-writer", move || {
        let chunk = vec![1u8; 256 * 1024];
        for _ in 0..400 {
            if stalled_leg.send(Message::binary(chunk.clone())).is_err() {
                break;
            }
        }
        read_close(&mut stalled_leg)
    });
    // Meanwhile the other pair keeps its round trips fast.
    let started = orca_relay::clock::instant();
    let mut worst = Duration::ZERO;
    while started.elapsed() < Duration::from_secs(2) {
        let sent = orca_relay::clock::instant();
        busy_phone.send(Message::binary(vec![9u8; 64])).unwrap();
        let got = busy_leg.read().unwrap();
        busy_leg.send(got).unwrap();
        let _ = busy_phone.read().unwrap();
        worst = worst.max(sent.elapsed());
    }
    assert!(
        worst < Duration::from_millis(500),
        "worst round trip {worst:?}"
    );
    assert_eq!(writer.unwrap().join().unwrap(), Some(4429));
    drop(stalled_phone);
}

#[test]
fn every_path_releases_its_slot_and_the_process_keeps_serving() {
    let relay = Relay::combined(&[
        ("ORCA_RELAY_FIRST_FRAME_MS", "300"),
        ("ORCA_RELAY_ATTACH_DEADLINE_MS", "300"),
    ]);
    let baseline = relay.metric("orca_relay_connection_units").unwrap();
    let mut desktop = Desktop::connect(&relay);
    for round in 0..20 {
        // Refused at upgrade.
        let _ = ws_connect(&relay.ws_url("/v1/host/control"), Some("bad"));
        let _ = ws_connect(&relay.ws_url("/nowhere"), None);
        // Abandoned before the head.
        let mut half = TcpStream::connect(&relay.ws).unwrap();
        half.write_all(b"GET /v1/host/con").unwrap();
        drop(half);
        // Abandoned after the upgrade, before the first frame.
        drop(ws_connect(&relay.ws_url("/v1/connect/abcdefghijklmnop"), None).unwrap());
        // Refused after the first frame.
        let mut phone = ws_connect(
            &relay.ws_url(&format!("/v1/connect/{}", desktop.relay_host_id)),
            None,
        )
        .unwrap();
        send_json(
            &mut phone,
            serde_json::json!({"type":"relay-auth","v":1,"credential":"nope"}),
        );
        assert_eq!(read_close(&mut phone), Some(4401), "round {round}");
        // A spliced pair torn down abruptly.
        if round % 5 == 0 {
            let (phone, leg) = splice(&relay, &mut desktop);
            drop(phone);
            drop(leg);
        }
    }
    drop(desktop);
    assert!(
        wait_until(Duration::from_secs(10), || relay
            .metric("orca_relay_connection_units")
            == Some(baseline)),
        "units {:?} != baseline {baseline}",
        relay.metric("orca_relay_connection_units")
    );
    let _still = Desktop::connect(&relay);
    assert_eq!(relay.get("/health").0, 200);
}

#[test]
fn the_control_holds_its_activity_lease_row_only_while_connected() {
    let relay = Relay::combined(&[]);
    let store = orca_relay::store::Store::open(&orca_relay::store::StoreConfig::new(
        None,
        relay.data_dir.0.join("relay.db"),
    ))
    .unwrap();
    let now = || orca_relay::clock::system().now_ms() as i64;
    let desktop = Desktop::connect(&relay);
    let host = desktop.relay_host_id.clone();
    assert_eq!(
        store.live_leases_for_host(&host, now()).unwrap(),
        1,
        "a database-admitted control holds its lease row"
    );
    drop(desktop);
    assert!(
        wait_until(Duration::from_secs(10), || store
            .live_leases_for_host(&host, now())
            .unwrap()
            == 0),
        "the lease row outlived the control"
    );
}

#[test]
fn splice_legs_forward_fragments_and_answer_pings() {
    use tungstenite::protocol::frame::coding::{Data, OpCode};
    use tungstenite::protocol::frame::Frame;
    let relay = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&relay);
    let (mut phone, mut leg) = splice(&relay, &mut desktop);
    // A text message in three fragments arrives whole at the other side.
    let fragments = [
        ("frag", false, Data::Text),
        ("men", false, Data::Continue),
        ("ted", true, Data::Continue),
    ];
    for (part, fin, data) in fragments {
        phone
            .write(Message::Frame(Frame::message(
                part.as_bytes().to_vec(),
                OpCode::Data(data),
                fin,
            )))
            .unwrap();
    }
    phone.flush().unwrap();
    match leg.read().unwrap() {
        Message::Text(text) => assert_eq!(text.as_str(), "fragmented"),
        other => panic!("expected the reassembled text, got {other:?}"),
    }
    // A ping on a splice leg is answered by the relay itself, and data still flows after it.
    phone
        .send(Message::Ping(b"are you there".to_vec().into()))
        .unwrap();
    match phone.read().unwrap() {
        Message::Pong(payload) => assert_eq!(&payload[..], b"are you there"),
        other => panic!("expected a pong, got {other:?}"),
    }
    leg.send(Message::binary(vec![1, 2, 3])).unwrap();
    assert_eq!(phone.read().unwrap(), Message::binary(vec![1, 2, 3]));
}

#[test]
fn an_unmasked_frame_from_a_phone_is_a_protocol_error() {
    let relay = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&relay);
    let invite = desktop.invite();
    let mut raw = TcpStream::connect(&relay.ws).unwrap();
    raw.write_all(
        format!(
            "GET /v1/connect/{} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
            desktop.relay_host_id
        )
        .as_bytes(),
    )
    .unwrap();
    // A masked relay-auth (mask of zeros keeps the payload readable), then one unmasked frame.
    let auth = serde_json::json!({"type":"relay-auth","v":1,"credential":invite}).to_string();
    let mut frame = vec![0x81, 0x80 | auth.len() as u8, 0, 0, 0, 0];
    frame.extend_from_slice(auth.as_bytes());
    raw.write_all(&frame).unwrap();
    let (conn_id, ticket) = desktop.conn_open();
    let mut leg = desktop.data_leg(&relay, &conn_id, &ticket);
    raw.write_all(&[0x82, 0x03, 1, 2, 3]).unwrap();
    assert_eq!(
        read_close(&mut leg),
        Some(4408),
        "the other side is told its peer left"
    );
    // The phone's stream ends with a close frame carrying 1002.
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut bytes = Vec::new();
    let _ = raw.read_to_end(&mut bytes);
    let close_at = bytes
        .windows(2)
        .position(|w| w[0] == 0x88)
        .expect("a close frame");
    assert_eq!(&bytes[close_at + 2..close_at + 4], &1002u16.to_be_bytes());
}
