//! Messages between instances: publish on a topic, subscribe to one.
//!
//! ```ignore
//! let tasks = messages::subscribe("swarm.tasks")?;   // messages from now on are kept
//! messages::broadcast("swarm.results", "w1: done");  // every current subscriber gets it
//! let task = tasks.next().await;
//! ```
//!
//! A broadcast reaches only instances subscribed at that moment (the publisher too, if it
//! subscribed), so a protocol should have subscribers announce themselves before work is
//! published (e.g. `inferlet::send("subscribed")` for the launching client).

use crate::bindings::messaging;
use crate::bindings::types::Error;

/// Sends `message` to every current subscriber of `topic`.
pub fn broadcast(topic: &str, message: &str) {
    messaging::broadcast(topic, message)
}

/// Subscribes to `topic`: messages broadcast from now on are kept for [`Subscription::next`].
pub fn subscribe(topic: &str) -> Result<Subscription, Error> {
    Ok(Subscription { topic: topic.to_string(), raw: messaging::subscribe(topic)? })
}

/// A subscription to one topic; dropping it unsubscribes.
pub struct Subscription {
    topic: String,
    raw: messaging::Subscription,
}

impl Subscription {
    /// The topic subscribed to.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The next message on the topic not yet handed out (waits for one).
    pub async fn next(&self) -> String {
        self.raw.next().await
    }

    /// The next message for which `keep` holds; the others are skipped.
    pub async fn next_matching(&self, keep: impl Fn(&str) -> bool) -> String {
        loop {
            let message = self.next().await;
            if keep(&message) {
                return message;
            }
        }
    }
}
