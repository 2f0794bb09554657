package yieldloop

import (
	"context"
	"io"
	"io/ioutil"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	checkpointv1 "yieldloop.dev/client/gen/yieldloop/checkpoint/v1"
	commonv1 "yieldloop.dev/client/gen/yieldloop/common/v1"
	rolloutv1 "yieldloop.dev/client/gen/yieldloop/rollout/v1"
	trainerv1 "yieldloop.dev/client/gen/yieldloop/trainer/v1"
)

// TestAgainstALiveStack drives a `yieldloop up --tls`: YIELDLOOP_DATA_DIR's, or one it starts (YIELDLOOP names
// the command when it is not on PATH): list models, Generate, a head moved by a training step, error reasons, a
// call without a key refused.
func TestAgainstALiveStack(t *testing.T) {
	dir := os.Getenv("YIELDLOOP_DATA_DIR") // a running stack (the Python tests' own, in tests/test_polyglot.py)
	if dir == "" {
		dir = startStack(t)
	}
	client, err := FromDataDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	models, err := client.Checkpoint.ListModels(ctx, &checkpointv1.ListModelsRequest{})
	if err != nil {
		t.Fatal(AsError(err))
	}
	found := false
	for _, m := range models.Models {
		found = found || m.Slug == "tiny"
	}
	if !found {
		t.Fatalf("tiny not listed: %v", models.Models)
	}

	stream, err := client.Rollout.Generate(ctx, &rolloutv1.GenerateRequest{
		Model:    "tiny",
		Prompt:   &rolloutv1.GenerateRequest_PromptTokenIds{PromptTokenIds: &rolloutv1.PromptTokens{TokenIds: []int32{1, 40, 41}}},
		Sampling: &rolloutv1.SamplingParams{MaxTokens: 6, Temperature: 1, IgnoreEos: true},
	})
	if err != nil {
		t.Fatal(AsError(err))
	}
	var tokens []int32
	var logprobs []float32
	for {
		response, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(AsError(err))
		}
		tokens = append(tokens, response.TokenIds...)
		logprobs = append(logprobs, response.Logprobs...)
		if response.WeightVersion != "base" {
			t.Fatalf("weight version %q", response.WeightVersion)
		}
	}
	if len(tokens) != 6 || len(logprobs) != 6 {
		t.Fatalf("%d tokens, %d logprobs", len(tokens), len(logprobs))
	}

	// A training step on a fork moves its head.
	if _, err := client.Checkpoint.ForkModel(ctx, &checkpointv1.ForkModelRequest{Source: "tiny", Name: "go-fork"}); err != nil {
		t.Fatal(AsError(err))
	}
	before, err := client.Checkpoint.GetHead(ctx, &checkpointv1.GetHeadRequest{Model: "go-fork"})
	if err != nil {
		t.Fatal(AsError(err))
	}
	fb, err := client.Trainer.ForwardBackward(ctx)
	if err != nil {
		t.Fatal(AsError(err))
	}
	fb.Send(&trainerv1.ForwardBackwardRequest{Item: &trainerv1.ForwardBackwardRequest_Config{
		Config: &trainerv1.ForwardBackwardConfig{LossFn: "cross_entropy", Model: "go-fork"}}})
	fb.Send(&trainerv1.ForwardBackwardRequest{Item: &trainerv1.ForwardBackwardRequest_Datum{Datum: &commonv1.Datum{
		InputTokens: []int32{1, 40, 41}, TargetTokens: []int32{40, 41, 42}, Weights: []float32{0, 1, 1}}}})
	result, err := fb.CloseAndRecv()
	if err != nil {
		t.Fatal(AsError(err))
	}
	if result.NumDatums != 1 {
		t.Fatalf("%d datums", result.NumDatums)
	}
	step, err := client.Trainer.OptimStep(ctx, &trainerv1.OptimStepRequest{
		Adam: &trainerv1.AdamParams{LearningRate: 1e-3}, SetHead: true, Model: "go-fork", IdempotencyKey: "go-step-1"})
	if err != nil {
		t.Fatal(AsError(err))
	}
	after, err := client.Checkpoint.GetHead(ctx, &checkpointv1.GetHeadRequest{Model: "go-fork"})
	if err != nil {
		t.Fatal(AsError(err))
	}
	if after.Head.CheckpointId != step.Checkpoint.CheckpointId || after.Head.Sequence != before.Head.Sequence+1 {
		t.Fatalf("head %v after step %v", after.Head, step.Checkpoint)
	}

	// Errors carry their reason and field.
	_, err = client.Checkpoint.GetModel(ctx, &checkpointv1.GetModelRequest{Model: "no-such-model"})
	if e := AsError(err); e == nil || e.Code != "NOT_FOUND" || e.Reason != "MODEL_NOT_FOUND" {
		t.Fatalf("got %v", e)
	}
	_, err = client.Checkpoint.SetHead(ctx, &checkpointv1.SetHeadRequest{Model: "go-fork", CheckpointId: "step-999999-none"})
	if e := AsError(err); e == nil || e.Reason != "CHECKPOINT_NOT_FOUND" {
		t.Fatalf("got %v", e)
	}
	anonymous, err := New(Options{Checkpoint: client.Options.Checkpoint, TLSCAFile: client.Options.TLSCAFile})
	if err != nil {
		t.Fatal(err)
	}
	defer anonymous.Close()
	_, err = anonymous.Checkpoint.ListModels(ctx, &checkpointv1.ListModelsRequest{})
	if e := AsError(err); e == nil || e.Code != "UNAUTHENTICATED" || e.Reason != "API_KEY_MISSING" {
		t.Fatalf("got %v", e)
	}
}

// startStack starts `yieldloop up --tls` in a temporary data directory, stopped (and removed) when the test ends.
func startStack(t *testing.T) string {
	dir, err := ioutil.TempDir("", "yieldloop-go-")
	if err != nil {
		t.Fatal(err)
	}
	command := os.Getenv("YIELDLOOP")
	if command == "" {
		command = "yieldloop"
	}
	up := exec.Command(command, "up", "--data-dir", dir, "--tls", "--no-hud")
	up.Stdout, up.Stderr = os.Stderr, os.Stderr
	if err := up.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		up.Process.Signal(syscall.SIGINT)
		up.Wait()
		os.RemoveAll(dir)
	})
	deadline := time.Now().Add(5 * time.Minute)
	for {
		files, _ := filepath.Glob(filepath.Join(dir, "run", "*.json"))
		if len(files) >= 4 {
			return dir
		}
		if time.Now().After(deadline) {
			t.Fatal("the stack did not start in time")
		}
		time.Sleep(200 * time.Millisecond)
	}
}
