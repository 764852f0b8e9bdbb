//! The iopub channel: one task owns the XPUB socket, publishes what the rest
//! of the kernel queues, and greets each new subscriber (JEP 65).

use bytes::Bytes;
use jupyter_protocol::{IoPubWelcome, JupyterMessage};
use jupyter_zmq_client::{KernelIoPubXPubConnection, SubscriptionEvent};
use tokio::sync::{mpsc, oneshot};

// Boxed: a message is many times larger than a flush.
enum Item {
    Message(Box<JupyterMessage>),
    Flush(oneshot::Sender<()>),
}

/// A handle to queue messages for iopub; cheap to clone.
#[derive(Clone)]
pub struct Iopub {
    queue: mpsc::UnboundedSender<Item>,
}

impl Iopub {
    /// Starts the publishing task on `socket`.
    pub fn start(mut socket: KernelIoPubXPubConnection) -> Iopub {
        let (queue, mut items) = mpsc::unbounded_channel::<Item>();
        tokio::spawn(async move {
            loop {
                // Subscriptions are only registered while the socket is being read,
                // so the task reads and publishes in turn.
                let next = tokio::select! {
                    event = socket.recv_subscription() => Err(event),
                    item = items.recv() => Ok(item),
                };
                match next {
                    Ok(Some(Item::Message(message))) => {
                        let topic = format!("kernel.{}.{}", socket.session_id, message.message_type());
                        let message = (*message).with_zmq_identities(vec![Bytes::from(topic)]);
                        if let Err(err) = socket.send(message).await {
                            log::warn!("iopub: could not publish: {err}");
                        }
                    }
                    Ok(Some(Item::Flush(done))) => {
                        let _ = done.send(());
                    }
                    Ok(None) => return,
                    Err(Ok(SubscriptionEvent::Subscribe(topic))) => {
                        let identities = if topic.is_empty() { vec![] } else { vec![Bytes::from(topic.clone())] };
                        let welcome = JupyterMessage::from(IoPubWelcome { subscription: topic }).with_zmq_identities(identities);
                        if let Err(err) = socket.send(welcome).await {
                            log::warn!("iopub: could not send the welcome message: {err}");
                        }
                    }
                    Err(Ok(SubscriptionEvent::Unsubscribe(_))) => {}
                    Err(Err(err)) => log::debug!("iopub: unreadable subscription message: {err}"),
                }
            }
        });
        Iopub { queue }
    }

    pub fn send(&self, message: JupyterMessage) {
        if self.queue.send(Item::Message(Box::new(message))).is_err() {
            log::debug!("iopub is closed; a message was dropped");
        }
    }

    /// Waits until everything queued so far has been published.
    pub async fn flush(&self) {
        let (done, wait) = oneshot::channel();
        if self.queue.send(Item::Flush(done)).is_ok() {
            let _ = wait.await;
        }
    }
}
