//! `hello`: echoes what it receives.
//!
//! Sends its launch arguments back as one message (joined by spaces), then echoes every
//! message the client sends, until the client sends an empty message or "quit" (not
//! echoed), and ends normally.

inferlet::main!(main);

async fn main() -> Result<(), String> {
    inferlet::send(&inferlet::args().join(" "));
    loop {
        let message = inferlet::receive().await;
        if message.is_empty() || message == "quit" {
            return Ok(());
        }
        inferlet::send(&message);
    }
}
